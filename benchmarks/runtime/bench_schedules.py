"""Schedules benchmark: fxpipe's 1F1B, interleaved 1F1B, ZB-H1, ZBV and DualPipeV against torch.distributed.pipelining.

    .venv/bin/python benchmarks/runtime/bench_schedules.py [--steps 20] [--model gpt_medium] [--out benchmarks/runtime]

For each microbatch count M in (S, 2S) on S = 2 ranks it traces the model once (unit times
measured with one thread, as each worker runs) and plans one build per schedule (interleaved
ZBV and DualPipeV with 2 stages per rank). Then one torchrun job (2 ranks, gloo, CPU) times, for
each build, fxpipe's ``PipelineRunner`` and the peer schedule (``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``,
``ScheduleDualPipeV``; the peer's DualPipeV needs M >= 2S, so at M = S only fxpipe's runs) driving ``PipelineStage``s that wrap the SAME ``load_stage`` modules of this rank, alternately
step by step, each step between two barriers. Both sum tied gradients (fxpipe by itself, the
peer loop by hand) and both start from the same weights. Reported: median step of each and the
ratio fxpipe / peer; fxpipe's measured bubble (1 - the ranks' compute time / (ranks x step)),
from the executor's per-action times) and step against fxpipe's 1F1B at the same M; and the
plan's predicted step against the measured one. Writes ``schedules.json`` and ``schedules.md``.

The phases can run apart, e.g. the timing on a quieter machine with the same checkout:
``--build-to DIR`` only writes the build directories; ``--from-builds DIR --raw-out FILE``
only times them (and ``--profile-out DIR`` traces the model there again, measuring unit
times on that machine); ``--from-builds DIR --raw FILE [--profiles DIR]`` writes the tables
from those, re-pricing each plan's split with the profiles measured where it ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "gpt_medium": ROOT / "benchmarks" / "runtime" / "gpt_medium.py",
    "gpt": ROOT / "examples" / "gpt.py",
}
RANKS, BATCH, LR = 2, 16, 0.01
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
PEERS = {
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "zb-h1": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}


def _peer_runs(name: str, microbatches: int) -> bool:
    """Whether the peer has this schedule at this size (its DualPipeV refuses M < 2S)."""
    import torch.distributed.pipelining as pp

    return hasattr(pp, PEERS[name]) and not (name == "dualpipev" and microbatches < 2 * RANKS)


def _build(model_file: Path, root: Path, microbatches: int) -> None:
    """One trace, one build per schedule (each planned for its own step time)."""
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    torch.set_num_threads(1)
    source = load_model_file(model_file)
    traced = trace_model_file(source, BATCH // microbatches, measure_times=True)
    for name in SCHEDULES:
        plan = plan_partition(traced.profile, RANKS, microbatches=microbatches, schedule=name)
        write_build_dir(
            traced,
            plan,
            root / f"{name}-m{microbatches}",
            source,
            batch_size=BATCH,
            microbatches=microbatches,
        )


class _PeerStage(torch.nn.Module):
    """An fxpipe stage as the peer needs it. The peer passes each stage's whole output to the next
    stage only, so a tensor that skips stages (fxpipe sends it straight to its consumer) is relayed:
    every stage takes the tensors that stages from it on still need, in a fixed order, and returns
    those that later stages need. The last stage returns its model output bare (pipelining hands
    it to loss_fn as it is), and for the peer's split backward every output is a copy (``clone``):
    it calls ``detach_()`` on the outputs, which fails on views and breaks the backward of any op
    that saved that tensor (GPT's residual stream). fxpipe's runtime needs none of this."""

    def __init__(self, inner: torch.nn.Module, manifest, index: int, copy_outputs: bool) -> None:
        super().__init__()
        self.inner, self.index, self.copy_outputs = inner, index, copy_outputs
        spec = manifest.stage(index)
        self.inputs = [t.name for t in spec.inputs]
        self.outputs = [t.name for t in spec.outputs]
        self.last = index == manifest.num_stages - 1
        self.carried_in = _carried(manifest, index)
        self.carried_out = [] if self.last else _carried(manifest, index + 1)

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        have = dict(zip(self.carried_in, args))
        out = self.inner(*(have[n] for n in self.inputs))
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        have.update(zip(self.outputs, outs))
        result = outs if self.last else tuple(have[n] for n in self.carried_out)
        if self.copy_outputs:
            result = tuple(o.clone() for o in result)
        return result[0] if self.last and len(result) == 1 else result


def _carried(manifest, index: int) -> list[str]:
    """Names of the tensors stage ``index`` receives in the relay: model inputs (stage 0) or what
    earlier stages made (or the model fed in) and stages from ``index`` on read."""
    if index == 0:
        return [t.name for t in manifest.inputs]
    later = {t.name for s in manifest.stages[index:] for t in s.inputs}
    made = [t.name for t in manifest.inputs] + [
        o.name for s in manifest.stages[:index] for o in s.outputs
    ]
    return [n for n in dict.fromkeys(made) if n in later]


def _peer(build_dir: Path, name: str, microbatches: int, source, rank: int, device: str = "cpu"):
    """The peer's schedule over PipelineStages wrapping this rank's load_stage modules; a step function."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pp

    from fxpipe.codegen import load_stage
    from fxpipe.codegen.manifest import Manifest

    manifest = Manifest.from_json(build_dir)
    mine = [s for s, r in enumerate(manifest.stage_ranks) if r == rank]
    modules = {s: load_stage(build_dir, s, device=device) for s in mine}
    last = manifest.num_stages - 1
    split = name in ("zb-h1", "zbv", "dualpipev")
    stages = [
        pp.PipelineStage(
            _PeerStage(modules[s], manifest, s, split), s, manifest.num_stages, torch.device(device)
        )
        for s in mine
    ]
    cls = getattr(pp, PEERS[name])
    sched = cls(
        stages[0] if len(stages) == 1 and name == "1f1b" else stages,
        n_microbatches=microbatches,
        loss_fn=source.loss_fn,
    )
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    # Tied parameters (GPT's wte/lm_head): sum every copy's gradient (fxpipe does this by itself)
    shapes = {(s, k): p.shape for s in modules for k, p in modules[s].named_parameters()}
    ties = []
    for t in manifest.ties:
        copies = [modules[s].get_parameter(k) for s, k in zip(t.stages, t.keys) if s in modules]
        spans = len({manifest.stage_ranks[s] for s in t.stages}) > 1
        shape = next((shapes[(s, k)] for s, k in zip(t.stages, t.keys) if (s, k) in shapes), None)
        ties.append((copies, spans, shape))
    inputs = tuple(x.to(device) for x in source.example_inputs(BATCH))
    targets = source.example_targets(BATCH).to(device)

    def step() -> None:
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if last in mine else {}
        args = inputs if 0 in mine else ()
        sched.step(*args, **kwargs)
        for copies, spans, shape in ties:  # every copy gets the sum of all copies' gradients
            total = (
                sum(p.grad for p in copies).clone()
                if copies
                else torch.zeros(shape or (), device=device)
            )
            if spans:
                dist.all_reduce(total)
            for p in copies:
                p.grad = total.clone()
        opt.step()

    return step


def _worker(root: Path, steps: int, model_file: Path, raw_out: Path) -> None:
    """Run under torchrun: every build, fxpipe and the peer alternating steps."""
    import torch.distributed as dist

    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source = load_model_file(model_file)
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    out = {}
    for build_dir in sorted(p for p in root.iterdir() if (p / "manifest.json").is_file()):
        name, m = build_dir.name.rsplit("-m", 1)
        M = int(m)
        fx = PipelineRunner(
            build_dir,
            source.loss_fn,
            microbatches=M,
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        )
        peer = _peer(build_dir, name, M, source, rank) if _peer_runs(name, M) else None
        times: dict[str, list[float]] = {"fxpipe": [], "peer": []}
        busy: list[float] = []
        runs = [("fxpipe", lambda: fx.step(inputs, targets))] + (
            [("peer", peer)] if peer is not None else []
        )
        for _ in range(3):
            for _, fn in runs:
                fn()
        for _ in range(steps):
            for label, fn in runs:
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[label].append(time.perf_counter() - t0)
                if label == "fxpipe":
                    busy.append(sum(a.end - a.start for a in fx.executor.last_step))
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"times": times, "busy": busy})
        out[build_dir.name] = gathered
        fx.close()
    if rank == 0:
        raw_out.write_text(json.dumps(out))
    dist.destroy_process_group()


def _profiles(model_file: Path, out: Path) -> None:
    """Trace the model at each benchmark microbatch size with measured unit times (this machine's)."""
    from fxpipe.modelfile import load_model_file
    from fxpipe.tracer import trace_model_file

    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    source = load_model_file(model_file)
    for m in (RANKS, 2 * RANKS):
        trace_model_file(source, BATCH // m, measure_times=True).profile.to_json(
            out / f"profile-m{m}.json"
        )


def _repriced(plan, profile_path: Path):
    """``plan``'s split priced again with another profile of the same model (unit times measured elsewhere)."""
    from dataclasses import replace

    from fxpipe.partitioner import build_problem, predict
    from fxpipe.tracer.profile import ModelProfile

    profile = ModelProfile.from_json(profile_path)
    problem = build_problem(
        profile,
        plan.num_ranks,
        schedule=plan.schedule,
        microbatches=plan.microbatches,
        cost=plan.cost,
        virtual_stages=plan.virtual_stages,
    )
    assignment = tuple(plan.stage_of(u.name) for u in profile.units)
    return replace(plan, prediction=predict(problem, assignment, profile.batch_size))


def _summary(root: Path, raw_path: Path, profiles: Path | None = None) -> list[dict]:
    from fxpipe.partitioner import PartitionPlan

    raw = json.loads(raw_path.read_text())
    rows = []
    for key, per_rank in sorted(raw.items()):
        name, m = key.rsplit("-m", 1)
        plan = PartitionPlan.from_json(root / key / "plan.json")
        planned = plan.predicted_step_ms(name, microbatches=int(m))
        if profiles is not None:
            plan = _repriced(plan, profiles / f"profile-m{m}.json")
        fx = [statistics.median(r["times"]["fxpipe"]) * 1e3 for r in per_rank]
        pp = [statistics.median(r["times"]["peer"]) * 1e3 for r in per_rank if r["times"]["peer"]]
        step_ms, peer_ms = max(fx), (max(pp) if pp else None)
        # per step, each rank's compute time over the step (the same steps: alternate runs of fxpipe)
        bubbles = []
        for k in range(len(per_rank[0]["busy"])):
            wall = max(r["times"]["fxpipe"][k] for r in per_rank)
            bubbles.append(1.0 - sum(r["busy"][k] for r in per_rank) / (len(per_rank) * wall))
        pred = plan.predicted_step_ms(name, microbatches=int(m))
        rows.append(
            {
                "schedule": name,
                "microbatches": int(m),
                "virtual_stages": plan.virtual_stages,
                "fxpipe_step_ms": step_ms,
                "peer": PEERS[name],
                "peer_step_ms": peer_ms,
                "fxpipe_over_peer": step_ms / peer_ms if peer_ms else None,
                "measured_bubble": statistics.median(bubbles),
                "predicted_bubble": plan.prediction.bubble if plan.prediction else None,
                "predicted_step_ms": pred,
                "measured_over_predicted": step_ms / pred if pred else None,
                "predicted_at_build_ms": planned,
                "stage_ranks": list(plan.stage_ranks),
            }
        )
    base = {r["microbatches"]: r["fxpipe_step_ms"] for r in rows if r["schedule"] == "1f1b"}
    for r in rows:
        r["step_over_1f1b"] = r["fxpipe_step_ms"] / base[r["microbatches"]]
    return rows


def _markdown(rows: list[dict], model: str, steps: int) -> str:
    """The results table."""
    lines = [
        f"# Schedules benchmark ({model}, batch {BATCH}, {RANKS} ranks)",
        "",
        f"gloo on 127.0.0.1, CPU, one thread per rank, SGD; medians over {steps} timed steps, fxpipe and "
        "the peer alternating, each step between barriers. Predicted: each plan's split priced with unit "
        "times measured right before the timing (see README.md for the method).",
        "",
        "| schedule | M | V | fxpipe ms | peer | peer ms | fxpipe / peer | bubble (measured) | "
        "bubble (predicted) | step / fxpipe 1f1b | predicted ms | measured / predicted |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(rows, key=lambda r: (r["microbatches"], SCHEDULES.index(r["schedule"]))):
        pred = f"{r['predicted_step_ms']:.2f}" if r["predicted_step_ms"] else "n/a"
        ratio = f"{r['measured_over_predicted']:.2f}" if r["measured_over_predicted"] else "n/a"
        pb = f"{r['predicted_bubble']:.1%}" if r["predicted_bubble"] is not None else ""
        peer_ms = f"{r['peer_step_ms']:.2f}" if r["peer_step_ms"] else "n/a (needs M >= 2S)"
        over = f"{r['fxpipe_over_peer']:.2f}" if r["fxpipe_over_peer"] else "n/a"
        lines.append(
            f"| {r['schedule']} | {r['microbatches']} | {r['virtual_stages']} | {r['fxpipe_step_ms']:.2f} | "
            f"{r['peer']} | {peer_ms} | {over} | "
            f"{r['measured_bubble']:.1%} | {pb} | {r['step_over_1f1b']:.2f} | {pred} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def _time(root: Path, steps: int, model_file: Path, raw_out: Path) -> None:
    from launch_ranks import torchrun

    subprocess.run(
        torchrun(__file__, RANKS, str(root), str(steps), str(model_file), str(raw_out)),
        check=True,
    )


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--build", "--worker", "--trace"):
        mode, rest = sys.argv[1], sys.argv[2:]
        if mode == "--build":
            _build(Path(rest[0]), Path(rest[1]), int(rest[2]))
        elif mode == "--trace":
            _profiles(Path(rest[0]), Path(rest[1]))
        else:
            _worker(Path(rest[0]), int(rest[1]), Path(rest[2]), Path(rest[3]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt_medium")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument(
        "--build-to", type=Path, help="only write the build directories into this folder"
    )
    p.add_argument("--from-builds", type=Path, help="use the build directories in this folder")
    p.add_argument(
        "--raw-out",
        type=Path,
        help="with --from-builds: only time them, writing the raw times here",
    )
    p.add_argument(
        "--profile-out",
        type=Path,
        help="also trace the model here, unit times measured, into this folder",
    )
    p.add_argument(
        "--raw", type=Path, help="with --from-builds: the raw times of a --raw-out run to tabulate"
    )
    p.add_argument(
        "--profiles", type=Path, help="profiles from --profile-out to price the plans with"
    )
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    model_file = MODELS[args.model]
    if args.profile_out:
        subprocess.run(
            [sys.executable, __file__, "--trace", str(model_file), str(args.profile_out)],
            check=True,
        )
    with tempfile.TemporaryDirectory() as tmp:
        root = args.from_builds or args.build_to or Path(tmp)
        if args.from_builds is None:
            for m in (RANKS, 2 * RANKS):
                subprocess.run(
                    [sys.executable, __file__, "--build", str(model_file), str(root), str(m)],
                    check=True,
                )
            if args.build_to is not None:
                return
        if args.raw_out is not None:
            _time(root, args.steps, model_file, args.raw_out)
            return
        raw = args.raw or Path(tmp) / "raw.json"
        if args.raw is None:
            _time(root, args.steps, model_file, raw)
        rows = _summary(root, raw, args.profiles)
    meta = {
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "steps": args.steps,
        "model": args.model,
        "load_average": os.getloadavg(),
        "note": "shared 2-core machine; other jobs may have been running",
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "schedules.json").write_text(
        json.dumps({"meta": meta, "results": rows}, indent=1) + "\n"
    )
    text = _markdown(rows, args.model, args.steps)
    (args.out / "schedules.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
