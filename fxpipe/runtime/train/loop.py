"""The training loop of one rank under ``fxpipe run``: data, optimizer, schedule, clipping, eval, checkpoints, logs.

Trains the build directory's model with the options' optimizer and learning-rate schedule
(``fxpipe.runtime.train.optim``) on the batches of the model file's ``train_batches`` (or
``--data``; ``fxpipe.runtime.train.data_iter``), else on ``example_inputs(B)`` /
``example_targets(B)`` every step, with the model file's ``loss_fn`` or, without one, the
loss the model computes itself (``fxpipe.runtime.pipeline.loss``). With ``N = stages x R`` ranks
there are R data-parallel replicas of the pipeline, each on its own shard; the ranks of a pipeline
check that they drew one batch (``fxpipe.runtime.train.batch_check``). Every
``eval_every`` steps it evaluates (``PipelineRunner.eval_step``); every
``checkpoint_every`` steps and after the last it saves a checkpoint
(``fxpipe.runtime.train.checkpoint``), from which ``resume`` continues bit-for-bit.
Rank 0 prints one line per ``log_every`` steps (loss averaged over replicas, learning
rate, gradient norm, samples/s, step time, ETA) and writes ``DIR/run.json`` (a
``RunRecord``, only into the build it ran: Note [a record names its build] in
``fxpipe.runtime.train.run_record``); after the timed steps every rank trains one more (untimed,
unreported) accumulation window to measure its peak tensor memory
(``fxpipe.runtime.pipeline.peak_memory``). Before the first step every rank checks the checkpoint
directory and what a resume carries over (``fxpipe.runtime.train.resume``); a NaN or infinite
loss stops the run (Note [a diverged run stops] in ``fxpipe.runtime.train.divergence``).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.train.data import example_batch, model_source, replica_batch, target_batch_dims
from fxpipe.runtime.train.batch_check import check_same_batch
from fxpipe.runtime.train.data_iter import (
    EVAL_FN,
    TRAIN_FN,
    Batch,
    BatchFn,
    RankInfo,
    batch_stream,
    find_batches,
    rank_needs_inputs,
)
from fxpipe.runtime.pipeline.peak_memory import peak_memory_bytes, training_peak_tensor_bytes
from fxpipe.runtime.pipeline.microbatch import check_divisible
from fxpipe.runtime.train.optim import optimizer_factory, scheduler_factory
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.pipeline.p2p import peer_error
from fxpipe.runtime.train.run_record import (
    RunRecord,
    build_sha256,
    read_build_plan,
    write_run_record,
)
from fxpipe.runtime.pipeline.runner import PipelineRunner
from fxpipe.runtime.train.log import TensorBoardLog, progress_line, progress_wanted, start_up_note
from fxpipe.userfiles import shown

if TYPE_CHECKING:
    from fxpipe.partitioner.plan import PartitionPlan
from fxpipe.runtime.train.checkpoint import (
    check_checkpoint_dir,
    load_training_checkpoint,
    restore_training_state,
)
from fxpipe.runtime.train.dcp_checkpoint import (
    check_dcp_keys,
    is_dcp,
    layout_of,
    load_dcp_checkpoint,
    local_tensors,
    save_dcp_checkpoint,
)
from fxpipe.runtime.train.reshard_resume import check_layout_resume, layout_note, resume_record
from fxpipe.runtime.train.divergence import (
    agree,
    divergence_error,
    finite_or_none,
    non_finite_parameters,
    non_finite_step,
)
from fxpipe.runtime.train.resume import (
    ResumePlan,
    apply_options,
    build_identity,
    check_resume,
    checkpoint_meta,
    run_settings,
)

__all__ = ["train", "resolve_sizes", "format_log_line"]


def resolve_sizes(options: RunOptions, manifest: Manifest, world_size: int) -> tuple[int, int, int]:
    """(batch of one replica, microbatches, replicas): the options' values, else the build's
    and ``world_size / stages`` (Note [None is resolved where it is known] in ``fxpipe.runtime.train.run_options``)."""
    batch = options.batch_size or manifest.batch_size
    microbatches = options.microbatches or manifest.microbatches
    check_divisible(batch, microbatches)
    stages = manifest.num_ranks * options.tp  # processes per pipeline: V stages (chunks) x T each
    replicas = options.dp if options.dp is not None else max(world_size // stages, 1)
    if world_size != stages * replicas:
        raise RuntimeSetupError(
            f"--dp {replicas} needs {stages} stages x {replicas} = {stages * replicas} ranks, "
            f"but WORLD_SIZE is {world_size}; launch torchrun with --nproc-per-node "
            f"{stages * replicas} or drop --dp"
        )
    return batch, microbatches, replicas


def _mean_over_replicas(loss: float, runner: PipelineRunner) -> float:
    """This step's loss averaged over the replicas (each rank holds its own replica's)."""
    if runner.layout.replicas == 1:
        return loss
    total = torch.tensor(loss, dtype=torch.float32, device=runner.device)
    try:
        dist.all_reduce(total, group=runner.groups.data_parallel)
    except RuntimeError as exc:
        raise peer_error(
            exc, runner.rank, "averaging the step's loss over the replicas", runner.timeout_s
        ) from exc
    return float(total.item()) / runner.layout.replicas


def format_log_line(
    step: int,
    steps: int,
    loss: float,
    lr: float,
    grad_norm: float | None,
    samples_per_s: float,
    step_ms: float,
    eta_s: float,
) -> str:
    """One log line a person reads.

    >>> format_log_line(12, 100, 2.5, 3e-4, 1.25, 800.0, 12.5, 83)
    'step   12/100  loss 2.500000  lr 3.00e-04  grad norm 1.250  800.0 samples/s  12.50 ms/step  ETA 0:01:23'
    """
    norm = f"  grad norm {grad_norm:.3f}" if grad_norm is not None else ""
    eta = int(round(eta_s))
    return (
        f"step {step:4d}/{steps}  loss {loss:.6f}  lr {lr:.2e}{norm}  {samples_per_s:.1f} samples/s  "
        f"{step_ms:.2f} ms/step  ETA {eta // 3600}:{eta // 60 % 60:02d}:{eta % 60:02d}"
    )


def _repeat(batch: Batch) -> Iterator[Batch]:
    while True:
        yield batch


def rank_info(runner: PipelineRunner) -> RankInfo:
    """Where ``runner``'s rank sits, as a batch function sees it (which tensors it must read)."""
    return RankInfo(
        rank=runner.rank,
        world_size=runner.world_size,
        stage=runner.pipeline_rank,
        num_stages=runner.manifest.num_ranks,
        replica=runner.replica,
        replicas=runner.layout.replicas,
        needs_inputs=rank_needs_inputs(runner.manifest, sorted(runner.stages)),
        needs_targets=runner.executor.holds_loss,
    )


def _compile_report(runner: PipelineRunner) -> tuple[float, ...]:
    """Each stage's compile seconds, in stage order, on every rank (collective); rank 0 prints one
    line per stage of the first replica (Note [graph breaks are reported, not fatal] in
    ``fxpipe.runtime.pipeline.compiled``)."""
    got: list[Any] = [None] * runner.world_size
    dist.all_gather_object(got, [(c.stage, c.seconds, c.line()) for c in runner.compiled])
    seen: dict[int, tuple[float, str]] = {}
    for rank_reports in got:
        for stage, seconds, line in rank_reports:
            seen.setdefault(stage, (seconds, line))
    if runner.rank == 0:
        for stage in sorted(seen):
            print(f"fxpipe run: {seen[stage][1]}", flush=True)
    return tuple(seen[s][0] for s in sorted(seen))


def plan_mode_note(plan: PartitionPlan | None, compile: bool) -> str:
    """One line when the run's stages (``--compile`` or not) are not what the build's plan priced
    (``plan.compiled``; Note [compiled unit times] in ``fxpipe.tracer.measure.timing``); ``""`` when they
    are, or there is no plan."""
    if plan is None or plan.compiled == compile:
        return ""
    if compile:
        return (
            "fxpipe run: the plan was priced for eager stages and this run compiles them; "
            "partition with --compile to plan for compiled stages"
        )
    return (
        "fxpipe run: the plan was priced for compiled stages and this run is eager; "
        "run with --compile, or partition without it"
    )


def train(build_dir: Path, options: RunOptions, out: Path | None = None) -> RunRecord:
    """Train up to step ``options.steps`` on this rank (from a checkpoint with ``resume``); rank 0
    writes the record to ``out`` (default ``build_dir/run.json``). Every rank returns the record.
    A run whose loss stops being finite stops there and raises ``DivergenceError`` on every rank,
    its record written (Note [a diverged run stops] in ``fxpipe.runtime.train.divergence``)."""
    manifest = Manifest.from_json(build_dir)
    identity = build_identity(manifest, build_sha256(build_dir))  # Note [a record names its build]
    plan = read_build_plan(build_dir)
    source = model_source(build_dir, manifest)
    world = int(os.environ.get("WORLD_SIZE", manifest.num_ranks))
    batch, microbatches, replicas = resolve_sizes(options, manifest, world)
    dp, t = options.data_parallel, options.training
    # before any step: a directory this run cannot write, or whose files it did not write, is refused
    same_dir = (
        t.resume_from is not None
        and t.checkpoint_dir is not None
        and _same_dir(t.resume_from, t.checkpoint_dir)
    )
    saved = (
        check_checkpoint_dir(t.checkpoint_dir, t.resume or same_dir)
        if t.checkpoint_dir is not None
        else None
    )
    if t.resume_from is not None:  # Note [resuming into another layout]
        saved = resume_record(t.resume_from)
    from_dir = t.resume_from if t.resume_from is not None else t.checkpoint_dir
    keyed = saved is not None and (t.resume or t.resume_from is not None) and is_dcp(saved.meta)
    resuming: ResumePlan | None = None
    if keyed:
        assert saved is not None
        resuming = check_layout_resume(
            dict(saved.meta),
            options,
            batch,
            microbatches,
            replicas,
            identity,
            str(from_dir),
            "--resume-from" if t.resume_from is not None else "--resume",
        )
    else:
        resuming = (
            check_resume(
                dict(saved.meta),
                None,
                options,
                batch,
                microbatches,
                identity,
                str(t.checkpoint_dir),
            )
            if t.resume and saved is not None and saved.meta
            else None
        )
    train_fn = find_batches(source, t.data, TRAIN_FN)
    eval_fn = find_batches(source, t.eval_data, EVAL_FN) or train_fn
    target_dims = (
        target_batch_dims(source, batch)
        if source.has_loss_fn and source.has(source.targets_fn)
        else None
    )
    lr = options.lr
    settings = run_settings(options, batch, microbatches)
    lead_rank = os.environ.get("RANK", "0") == "0"
    if lead_rank and (note := plan_mode_note(plan, bool(options.compile))):
        print(note, flush=True)
    if lead_rank:  # Note [start-up phases] in fxpipe.runtime.launch.launcher
        start_up_note(f"rank 0 of {world} is up; loading its stages and joining the process group")
    with PipelineRunner(
        build_dir,
        source.loss_fn if source.has_loss_fn else None,
        schedule=options.schedule,
        microbatches=microbatches,
        optimizer_factory=optimizer_factory(t, lr),
        scheduler_factory=scheduler_factory(t, options.steps // dp.backward_passes_per_step),
        max_grad_norm=t.clip_grad_norm,
        device=options.device,
        timeout_s=options.timeout_s,
        data_parallel=dp,
        target_batch_dims=target_dims,
        virtual_stages=options.virtual_stages,
        recompute=plan.cost.recompute if plan is not None else (),
        precision=options.precision,
        check_batches=False,  # checked below, with the data function named (batch_check)
        compile=options.compile_scope if options.compile else False,
        compile_backward=options.compile_backward,
        compile_cache=options.compile_cache,
        compile_microbatch_size=batch // microbatches,
        compile_eval=t.eval_every is not None,  # Note [compiled eval graphs]
        compile_check=not options.compile_unchecked,
        tensor_parallel=options.tp,
        tp_plan=options.tp_plan,
    ) as runner:
        schedule = runner.schedule.name
        info = rank_info(runner)
        lead = runner.rank == 0
        compile_seconds = _compile_report(runner) if options.compile else ()
        if lead:
            start_up_note("stages loaded, process group up; first step")
        samples = batch * replicas
        history: dict[str, Any] = {"losses": [], "lrs": [], "grad_norms": [], "eval_losses": []}
        first = position = 0
        saved_after: int | None = None  # the step of the last checkpoint in checkpoint_dir
        if keyed:
            assert saved is not None and resuming is not None
            check_dcp_keys(runner, from_dir or "", saved)
            got = load_dcp_checkpoint(runner, from_dir or "", saved)
            apply_options(runner, options)  # Note [what a resume carries over]
            first, history = int(got["step"]), got["history"]
            position = int(got["samples"]) // samples  # Note [resuming into another layout]
            resuming = layout_note(
                resuming, dict(saved.meta.get("layout") or {}), layout_of(runner), got["rng"]
            )
            saved_after = first if same_dir or t.resume else None
        elif t.resume and saved is not None:
            state = load_training_checkpoint(t.checkpoint_dir or "", runner.rank, runner.world_size)
            if resuming is None:  # a checkpoint of an older fxpipe: its step is in the parts
                resuming = check_resume(
                    {},
                    int(state["step"]),
                    options,
                    batch,
                    microbatches,
                    identity,
                    str(t.checkpoint_dir),
                )
            restore_training_state(runner, state)
            apply_options(
                runner, options
            )  # this run's lr, weight decay, betas (Note [what a resume carries over])
            first, position, history = state["step"], state["data_position"], state["history"]
            saved_after = first
        elif t.resume and lead:
            print(
                f"fxpipe run: no checkpoint in {t.checkpoint_dir} yet; starting from step 0",
                flush=True,
            )
        if train_fn is not None:
            stream = batch_stream(train_fn, manifest, batch, info, start=position)
        else:
            every_replica = example_batch(source, manifest, batch * replicas)
            stream = _repeat(
                replica_batch(
                    *every_replica,
                    [s.batch_dim for s in manifest.inputs],
                    runner.replica,
                    batch,
                    target_dims,
                )
            )
        if lead:
            sync = f"shard {dp.shard}" if dp.shard != "none" else f"comm hook {dp.comm_hook}"
            dp_note = f" x {replicas} replicas ({sync})" if replicas > 1 else ""
            per_replica = " per replica" if replicas > 1 else ""
            print(
                f"fxpipe run: {manifest.num_stages} stages{dp_note}"
                + (f" x tp {options.tp}" if options.tp > 1 else "")
                + f" on {runner.world_size} ranks "
                f"({runner.device.type}), schedule {schedule}, batch {batch}{per_replica} = "
                f"{microbatches} x {batch // microbatches}, {t.optimizer} lr {lr:g} ({t.lr_schedule}"
                f"{f', {t.warmup_steps} warm-up steps' if t.warmup_steps else ''})"
                + (f", {options.precision} autocast" if options.precision != "fp32" else "")
                + (f", resuming after step {first}" if first else ""),
                flush=True,
            )
            for line in resuming.lines() if resuming is not None else ():
                print(line, flush=True)
            plan_lines = runner.tp_plan.summary(options.tp) if runner.tp_plan is not None else []
            for line in plan_lines:  # what --tp splits, and what stays replicated and why
                print(f"tp {options.tp}, {line}", flush=True)
        seconds: list[float] = []
        inputs, targets = None, None
        board = TensorBoardLog(t.tensorboard) if lead and t.tensorboard is not None else None
        progress = lead and progress_wanted()
        window: list[float] = []
        drawn = _drawn_by(train_fn, source.path.name, batch)
        stopped: str | None = None
        lr_now = lr
        for k in range(first, options.steps):
            inputs, targets = next(stream)
            position += 1
            if train_fn is not None or k == first:  # Note [one batch per pipeline under fxpipe run]
                inputs = check_same_batch(runner, inputs, targets, f"at step {k + 1}", drawn)
            lr_now = runner.optimizer.param_groups[0]["lr"] if runner.optimizer is not None else lr
            start = time.perf_counter()
            loss = runner.step(inputs, targets)
            seconds.append(time.perf_counter() - start)
            if (
                k == first
                and runner.rank == 0
                and not (k + 1) % t.log_every == 0
                and k + 1 != options.steps
            ):
                start_up_note(f"first step done in {seconds[-1]:.2f} s")  # its log line comes later
            window.append(seconds[-1])
            done = k + 1
            loss = _mean_over_replicas(loss, runner)  # outside the timed step
            norm = runner.last_grad_norm
            if runner.scaler is None:  # fp16's scaler skips a step of inf/NaN gradients itself
                stopped = non_finite_step(done, loss, norm, runner)
                if stopped is not None:  # the same on every rank: Note [a diverged run stops]
                    break
            history["losses"].append(finite_or_none(loss))
            history["lrs"].append(float(lr_now))
            if norm is not None:
                history["grad_norms"].append(finite_or_none(norm))
            logged = loss if math.isfinite(loss) else float("nan")
            if board is not None:
                board.scalars(
                    done,
                    {
                        "train/loss": finite_or_none(loss),
                        "train/lr": lr_now,
                        "train/grad_norm": finite_or_none(norm),
                        "train/samples_per_s": samples / seconds[-1],
                        "train/step_ms": seconds[-1] * 1e3,
                        "train/loss_scale": runner.scaler.scale
                        if runner.scaler is not None
                        else None,
                    },
                )
            if progress:
                print(
                    progress_line(
                        done,
                        options.steps,
                        logged,
                        statistics.median(seconds) * (options.steps - done),
                    ),
                    flush=True,
                )
            if lead and runner.scaler is not None and runner.scaler.skipped:
                print(
                    f"step {done} skipped: an inf/NaN gradient (fp16); loss scale now {runner.scaler.scale:g}",
                    flush=True,
                )
            if lead and (done % t.log_every == 0 or done == options.steps):
                recent = [v for v in history["losses"][-len(window) :] if v is not None] or [
                    float("nan")
                ]
                mean_s = sum(window) / len(window)
                print(
                    format_log_line(
                        done,
                        options.steps,
                        sum(recent) / len(recent),
                        lr_now,
                        norm,
                        samples / mean_s,
                        mean_s * 1e3,
                        statistics.median(seconds) * (options.steps - done),
                    ),
                    flush=True,
                )
                window = []
            if t.eval_every is not None and (done % t.eval_every == 0 or done == options.steps):
                held = (
                    batch_stream(eval_fn, manifest, batch, info, name=EVAL_FN)
                    if eval_fn is not None
                    else _repeat((inputs, targets))
                )  # no batch functions: the example batch
                val = _evaluate(
                    runner, held, t.eval_steps, done, _drawn_by(eval_fn, source.path.name, batch)
                )
                if not math.isfinite(val):
                    stopped = f"the evaluation loss after step {done} is {val}"
                    break
                history["eval_losses"].append([done, val])
                if board is not None:
                    board.scalars(done, {"eval/loss": val})
                if lead:
                    print(f"eval after step {done}: loss {val:.6f}", flush=True)
            if t.checkpoint_dir is not None and (
                done == options.steps
                or (t.checkpoint_every is not None and done % t.checkpoint_every == 0)
            ):
                stopped = non_finite_parameters(runner, local_tensors(runner), done)
                if stopped is not None:  # never a checkpoint of NaN weights
                    break
                save_dcp_checkpoint(  # Note [checkpoints keyed by the model]
                    t.checkpoint_dir,
                    runner,
                    done,
                    position * samples,
                    history,
                    checkpoint_meta(done, settings, identity),
                )
                saved_after = done
                if lead:
                    print(f"checkpoint after step {done}: {t.checkpoint_dir}", flush=True)
        if board is not None:
            board.close()
        if stopped is None:
            assert (
                inputs is not None
            )  # a run trains a step at least: a finished checkpoint is refused (resume.py)
            tensor_peak = training_peak_tensor_bytes(
                runner, inputs, targets, dp.backward_passes_per_step
            )
            peaks: list[Any] = [None] * runner.world_size
            try:  # over the whole world: one figure per rank, every replica included
                dist.all_gather_object(peaks, (peak_memory_bytes(runner.device), tensor_peak))
            except RuntimeError as exc:
                raise peer_error(
                    exc, runner.rank, "gathering peak memory", options.timeout_s
                ) from exc
        else:  # no more steps on weights that are NaN: no peak figures
            peaks = []
        steady = statistics.median(seconds[1:] or seconds)
        record = RunRecord(
            losses=tuple(history["losses"]),
            step_seconds=tuple(seconds),
            median_step_ms=steady * 1e3,
            samples_per_second=samples / steady,
            schedule=schedule,
            microbatches=microbatches,
            batch_size=batch,
            lr=lr,
            world_size=runner.world_size,
            num_stages=manifest.num_stages,
            device=runner.device.type,
            backend=dist.get_backend(),
            predicted_step_ms=None
            if plan is None or not plan.predicts_time
            else plan.predicted_step_ms(
                schedule,
                microbatches=microbatches,
                dp_replicas=replicas,
                comm_hook=dp.comm_hook,
                powersgd_rank=dp.powersgd_rank,
                shard=dp.shard,
            ),
            peak_memory_bytes=tuple(rss for rss, _ in peaks),
            peak_tensor_bytes=tuple(t for _, t in peaks),
            dp=replicas,
            global_batch_size=samples,
            comm_hook=dp.comm_hook,
            powersgd_rank=dp.powersgd_rank,
            shard_optimizer_state=dp.shard_optimizer_state,
            backward_passes_per_step=dp.backward_passes_per_step,
            optimizer=t.optimizer,
            precision=options.precision,
            lrs=tuple(history["lrs"]),
            grad_norms=tuple(history["grad_norms"]),
            eval_losses=tuple((int(s), float(v)) for s, v in history["eval_losses"]),
            first_step=first,
            build_sha256=identity["manifest_sha256"],
            stopped=stopped,
            compile_seconds=compile_seconds,
        )
        path = out or build_dir / "run.json"
        if stopped is None:
            if lead:
                path = write_run_record(record, build_dir, out)
                pred = record.predicted_step_ms
                if pred is not None:
                    said = f" (plan predicted {pred:.2f} ms{_host_load_note(runner.device.type)})"
                elif plan is not None and not plan.predicts_time:  # Note [analytic CPU estimate]
                    said = " (the plan's analytic CPU estimate ranks splits, it predicts no time: --measure-times does)"
                else:
                    said = ""
                print(
                    f"median step {record.median_step_ms:.2f} ms{said}; wrote {shown(path)}",
                    flush=True,
                )
            return record
        failed: BaseException | None = None
        if lead:
            try:
                write_run_record(record, build_dir, out)
            except Exception as exc:  # reported once the others know the record's fate
                failed = exc
        agree(runner, "stopping a diverged run")  # the record is on disk before any rank reports
        if failed is not None:
            raise failed
        raise divergence_error(stopped, float(lr_now), saved_after, t.checkpoint_dir, str(path))


def _same_dir(a: str, b: str) -> bool:
    return os.path.realpath(a) == os.path.realpath(b)


def _drawn_by(fn: BatchFn | None, model_file: str, batch: int) -> str:
    """The call that yields the batches, as an error names it."""
    return (
        f"{getattr(fn, '__name__', TRAIN_FN)}({batch}, rank_info)"
        if fn is not None
        else f"{model_file}'s example_inputs / example_targets"
    )


def _host_load_note(device: str) -> str:
    """On a CPU host busier than its cores (other work beside this job's ranks), a note that the prediction
    assumed none: the unit times it was made from did not share their cores."""
    if device != "cpu" or not hasattr(os, "getloadavg"):
        return ""
    cores, load = os.cpu_count() or 1, os.getloadavg()[0]
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if load <= 1.5 * max(cores, ranks):
        return ""
    return (
        f"; this host's load average was {load:.1f} on {cores} cores for {ranks} ranks: "
        "the prediction assumes no other work on them"
    )


def _evaluate(
    runner: PipelineRunner, batches: Iterator[Batch], steps: int, after: int, drawn: str
) -> float:
    """The mean ``eval_step`` loss over the next ``steps`` of ``batches``, averaged over the replicas."""
    total = 0.0
    for i in range(steps):
        inputs, targets = next(batches)
        inputs = check_same_batch(
            runner, inputs, targets, f"in the evaluation after step {after} (batch {i + 1})", drawn
        )
        total += runner.eval_step(inputs, targets)
    return _mean_over_replicas(total / steps, runner)
