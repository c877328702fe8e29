"""The ``fxpipe`` command: a thin shell over the tracer, partitioner, codegen and runtime.

Every verb maps to one public function. Nothing a verb raises becomes a traceback
(``--debug`` shows it): a user error (``FxpipeError``) prints as one ``error: …`` line and
exits 2; anything else (a bug, ``sys.exit()`` in a model file) prints ``error: internal
error while <phase>: <Type>: <message> (…)`` and exits 2, where the phase says what was
running; Ctrl-C exits 130; a closed standard output (``fxpipe … | head``) ends the verb
quietly with 141, as a process killed by ``SIGPIPE`` would.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
import typing
from pathlib import Path
from typing import Any, Sequence

from fxpipe.errors import FxpipeError
from fxpipe.optionspec import add_arguments, from_namespace
from fxpipe.partitioner.plan_options import PlanOptions
from fxpipe.partitioner.search.args import add_cluster_arguments
from fxpipe.tracer.trace_options import ModelTraceOptions
from fxpipe.unexpected import SignalStop, exits_raise, internal_error_line, one_line, print_safely
from fxpipe.userfiles import check_regular, refuse_overwrite, shown

__all__ = ["main", "build_parser"]


# -- shared option groups (dataclasses: Note [options declared once] in fxpipe.optionspec) ----------------


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_file", help="model file (path.py or path.py:build_fn)")
    add_arguments(p, ModelTraceOptions)


def _cluster_search(args: argparse.Namespace, profile: Any) -> Any:
    from fxpipe.partitioner.search.report import search_from_args

    _enter("searching configurations")
    return search_from_args(args, profile, _console())


# -- verbs ---------------------------------------------------------------------

_PHASE = [
    "starting"
]  # what the running verb is doing, for the one-line report of an unexpected error


def _enter(phase: str) -> None:
    _PHASE[0] = phase


def _console() -> Any:
    from rich.console import Console

    # Piped output (CI logs, files) gets room for the tables instead of rich's 80 columns.
    return Console(width=None if sys.stdout.isatty() else 132)


def _shown(path: str | Path) -> str:
    """A path for a rich console line: escaped if it holds a newline (``userfiles.shown``), and never read as markup."""
    from rich.markup import escape

    return escape(shown(path))


def _load_source(args: argparse.Namespace) -> Any:
    from fxpipe.modelfile import load_model_file

    _enter("loading the model file")
    options = from_namespace(ModelTraceOptions, args)
    return load_model_file(args.model_file, model_fn=options.model_fn, inputs_fn=options.inputs_fn)


def _trace(args: argparse.Namespace, source: Any, batch_size: int) -> Any:
    from fxpipe.tracer.trace_cache import trace_cached

    _enter("tracing")
    options = from_namespace(ModelTraceOptions, args)
    return trace_cached(
        source,
        batch_size,
        options.cache_dir(),
        budget=options.cache_budget(),
        **options.trace_kwargs(),
    )


def _plan(options: PlanOptions, profile: Any, stages: int, microbatches: int) -> Any:
    from fxpipe.partitioner import plan_partition

    _enter("planning")
    cost = options.cost_model(profile.trace_device)
    from fxpipe.tracer.progress import phase

    with phase("solve") as solving:
        plan = plan_partition(
            profile,
            stages,
            solver=options.solver,
            schedule=options.schedule,
            microbatches=microbatches,
            cost=cost,
            memory_limit=options.memory_limit_bytes,
            time_limit=options.time_limit,
            optimize=options.optimize,
            virtual_stages=options.virtual_stages,
            split_at=options.split_at,
        )
        solving.detail = f"{plan.solver}, {len(profile.units)} units into {plan.num_stages} stages"
    return plan


def _check_stages(stages: int | None) -> int:
    from fxpipe.errors import PartitionError

    if stages is None:
        raise PartitionError("give --stages N, or --devices N --global-batch G to search a cluster")
    if stages < 1:
        raise PartitionError(f"--stages must be >= 1, got {stages}")
    return stages


def _microbatching(
    batch_size: int | None, microbatches: int | None, stages: int | None
) -> tuple[int, int]:
    from fxpipe.errors import PartitionError

    stages = _check_stages(stages)
    m = stages if microbatches is None else microbatches
    if m < 1:
        raise PartitionError(f"--microbatches must be >= 1, got {m}")
    b = 2 * m if batch_size is None else batch_size
    if b < 1 or b % m:
        raise PartitionError(
            f"--batch-size {b} must be a positive multiple of --microbatches {m} "
            f"(each microbatch has batch-size/microbatches samples)"
        )
    return b, m


def _write_artifact(
    out_arg: str, text: str, reads: Sequence[str | Path] = (), option: str = "--out"
) -> Path:
    """Write ``text`` to ``--out`` whole or not at all, never over a file the verb ``reads``; an unwritable
    path is one error line."""
    from fxpipe.codegen.builddir import replace_file
    from fxpipe.errors import ConfigError

    out = Path(out_arg)
    refuse_overwrite(out, reads, option, ConfigError)
    if out.is_dir():
        raise ConfigError(
            f"--out {out_arg!r} is a directory; name a file, e.g. {str(out / 'out.json')!r}"
        )
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--out {out_arg!r}: cannot create its folder: {exc.strerror or exc}"
        ) from None
    replace_file(out, text + "\n")
    return out


def cmd_trace(args: argparse.Namespace) -> int:
    from fxpipe.tracer import print_profile_table

    source = _load_source(args)
    traced = _trace(args, source, args.batch_size)
    _enter("writing the profile")
    out = _write_artifact(args.out, traced.profile.to_json(), reads=[source.path])
    _enter("printing the profile")
    console = _console()
    print_profile_table(traced.profile, console=console)
    for line in traced.profile.recomputed_buffers:
        console.print(f"[cyan]recomputed[/] {line}")
    for reason in traced.profile.skipped_checks:
        console.print(f"[yellow]skipped[/] {reason}")
    console.print(
        f"[green]wrote[/] {_shown(out)} ({len(traced.profile.units)} units, frontend {traced.frontend})"
    )
    return 0


def cmd_plan(args: argparse.Namespace) -> int:
    from fxpipe.partitioner import print_plan_report
    from fxpipe.tracer.profile import ModelProfile

    if args.devices is None:
        _check_stages(args.stages)
    options = from_namespace(PlanOptions, args)
    _enter("reading the profile")
    if args.profile.endswith(".py") or re.search(r"\.py:\w+$", args.profile):
        from fxpipe.errors import ProfileError

        raise ProfileError(
            f"`fxpipe plan` takes a profile.json written by `fxpipe trace`, not a model file "
            f"({shown(args.profile)}); `fxpipe partition MODEL.py --stages N` traces, plans and "
            "writes the build in one go, `fxpipe trace MODEL.py` writes the profile"
        )
    profile = ModelProfile.from_json(
        Path(args.profile)
    )  # a Path: a file named {exp1} is never read as JSON text
    profile = options.priced(profile)  # --seq-len (Note [pricing at a length])
    if args.devices is not None:
        from fxpipe.partitioner.search.configurations import plan_configuration

        result = _cluster_search(args, profile)
        _enter("planning the best configuration")
        plan = plan_configuration(
            profile,
            result.cluster,
            result.best.config,
            optimizer=options.optimizer,
            time_limit=options.time_limit,
            cost_fields=result.cost_fields,
        )
        from fxpipe.jsonio import dump_json

        _write_artifact(
            str(Path(args.out).with_suffix(".search.json")),
            dump_json(result.to_dict(), what="search"),
            reads=[args.profile],
        )
    else:
        stages = _check_stages(options.stages)
        plan = _plan(
            options,
            profile,
            stages,
            stages if options.microbatches is None else options.microbatches,
        )
    _enter("writing the plan")
    out = _write_artifact(args.out, plan.to_json(), reads=[args.profile])
    _enter("printing the plan")
    console = _console()
    print_plan_report(plan, profile, console=console)
    console.print(f"[green]wrote[/] {_shown(out)}")
    if args.html:
        from fxpipe.partitioner.report.html import render_html_report

        _enter("writing the report")
        html = _write_artifact(
            args.html, render_html_report(plan, profile), reads=[args.profile, out], option="--html"
        )
        console.print(f"[green]wrote[/] {_shown(html)}")
    return 0


def _checkpoint_weights(weights: str | None, scratch: str) -> str | None:
    """``--weights``, or, when it names the --checkpoint-dir of a run (Note [checkpoints keyed by the
    model]), the model's state dict exported from it into ``scratch`` (safetensors)."""
    if weights is None or not (Path(weights) / "checkpoint.json").is_file():
        return weights
    from fxpipe.runtime.train.checkpoint import export_checkpoint

    _enter("reading the weights of the checkpoint")
    out = Path(scratch) / "model.safetensors"
    export_checkpoint(weights, out)
    return str(out)


def cmd_partition(args: argparse.Namespace) -> int:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fxpipe-weights-") as scratch:
        args.weights = _checkpoint_weights(args.weights, scratch)
        return _partition(args)


def _partition(args: argparse.Namespace) -> int:
    from fxpipe.codegen import check_build_target, write_build_dir
    from fxpipe.partitioner import print_plan_report

    out = Path(args.out)
    options = from_namespace(PlanOptions, args)
    if args.devices is not None:  # search, then trace again at the chosen microbatch size
        from fxpipe.partitioner.search.configurations import plan_configuration

        check_build_target(out)
        source = _load_source(args)
        traced = _priced(options, _trace(args, source, args.batch_size or 1))
        result = _cluster_search(args, traced.profile)
        best = result.best.config
        batch, micro = best.microbatch_size * best.microbatches, best.microbatches
        if best.microbatch_size != traced.profile.batch_size:
            traced = _priced(options, _trace(args, source, best.microbatch_size))
        _enter("planning the best configuration")
        plan = plan_configuration(
            traced.profile,
            result.cluster,
            best,
            optimizer=options.optimizer,
            time_limit=options.time_limit,
            cost_fields=result.cost_fields,
        )
    else:
        batch, micro = _microbatching(args.batch_size, options.microbatches, options.stages)
        check_build_target(out)  # before minutes of tracing; write_build_dir checks again
        source = _load_source(args)
        traced = _priced(options, _trace(args, source, batch // micro))
        plan = _plan(options, traced.profile, _check_stages(options.stages), micro)
    _enter("emitting the build directory")
    manifest = write_build_dir(
        traced,
        plan,
        out,
        source,
        batch_size=batch,
        microbatches=micro,
        check=not args.no_check,
        weights=args.weights,
    )
    _enter("printing the plan")
    console = _console()
    print_plan_report(plan, traced.profile, console=console)
    for line in traced.profile.recomputed_buffers:
        console.print(f"[cyan]recomputed[/] {line}")
    for reason in manifest.skipped_checks:
        console.print(f"[yellow]skipped[/] {reason}")
    for line in manifest.data_dependent():
        console.print(f"data-dependent shape: {line}", markup=False)
    placed = (
        f"{plan.num_stages} stages"
        if plan.virtual_stages == 1
        else f"{plan.num_stages} stages, {plan.virtual_stages} per rank on {plan.num_ranks} ranks"
    )
    console.print(
        f"[green]wrote[/] build directory {_shown(out)}/ ({placed}; open {_shown(out / 'report.html')})"
    )
    return 0


def _priced(options: PlanOptions, traced: Any) -> Any:
    """The traced model with its profile priced at ``--seq-len`` (Note [pricing at a length]): the
    plan, the report and the build's profile.json are of that length; codegen reads names only."""
    traced.profile = options.priced(traced.profile)
    return traced


def _load_plan_dir(build_dir: str) -> tuple[Any, Any]:
    from fxpipe.errors import BuildDirError
    from fxpipe.partitioner import PartitionPlan
    from fxpipe.tracer.profile import ModelProfile

    d = Path(build_dir)
    for name in ("plan.json", "profile.json"):
        check_regular(d / name, name, BuildDirError, "rebuild with `fxpipe partition`")
        if not (d / name).is_file():
            raise BuildDirError(
                f"{d / name} does not exist: run `fxpipe partition MODEL --out {d}` first"
            )
    return PartitionPlan.from_json(d / "plan.json"), ModelProfile.from_json(d / "profile.json")


def cmd_report(args: argparse.Namespace) -> int:
    from fxpipe.codegen import Manifest, write_report
    from fxpipe.partitioner import print_plan_report

    _enter("reading the build directory")
    plan, profile = _load_plan_dir(args.build_dir)
    measured, unpaired = _measured(Path(args.build_dir), len(plan.stages))
    _enter("reporting")
    console = _console()
    print_plan_report(plan, profile, console=console)
    for line in profile.recomputed_buffers:
        console.print(f"[cyan]recomputed[/] {line}", highlight=False)
    _print_tp_plan(Path(args.build_dir), console)
    if (Path(args.build_dir) / "manifest.json").is_file():
        for line in Manifest.from_json(Path(args.build_dir)).data_dependent():
            console.print(f"data-dependent shape: {line}", markup=False)
    if unpaired is not None:
        console.print(unpaired)
    if measured is not None:
        from fxpipe.partitioner.report.terminal import print_measurement

        print_measurement(plan, measured, console)
    if args.html:
        path = write_report(args.build_dir, plan, profile, measured=measured)
        console.print(f"[green]wrote[/] {_shown(path)}")
    return 0


def _print_tp_plan(build_dir: Path, console: Any) -> None:
    """The build's tensor-parallel plan at tp 2 (what ``fxpipe run --tp 2`` splits; docs/tensor-parallel.md)."""
    from fxpipe.codegen.tp_plan import TP_PLAN_FILE, TensorParallelPlan

    if not (build_dir / TP_PLAN_FILE).is_file():
        return
    for line in TensorParallelPlan.from_json(build_dir / TP_PLAN_FILE).summary(2):
        console.print(f"tensor-parallel plan at --tp 2, {line}", markup=False)


def _measured(build_dir: Path, num_stages: int) -> tuple[Any, str | None]:
    """What ``fxpipe run`` measured (``DIR/run.json``) in the plan's terms (None before a run), and
    why a run.json is not set beside this plan: a run of another build (Note [a record names its
    build] in ``fxpipe.runtime.train.run_record``)."""
    from fxpipe.partitioner.report.terminal import Measurement
    from fxpipe.runtime.train.run_record import RunRecord, build_sha256

    if not (build_dir / "run.json").is_file():
        return None, None
    run = RunRecord.from_json(build_dir / "run.json")
    if (
        run.build_sha256 is not None and run.build_sha256 != build_sha256(build_dir)
    ) or run.num_stages != num_stages:
        return None, (
            f"{build_dir / 'run.json'} is a run of another build ({run.num_stages} stages; this plan has "
            f"{num_stages}), not set beside this plan: run `fxpipe run {build_dir}` to measure this one"
        )
    return Measurement(
        step_ms=run.median_step_ms,
        peak_tensor_bytes=run.peak_tensor_bytes,
        schedule=run.schedule,
        microbatches=run.microbatches,
        world_size=run.world_size,
        device=run.device,
        predicted_step_ms=run.predicted_step_ms,
    ), None


def cmd_verify(args: argparse.Namespace) -> int:
    from fxpipe.codegen import print_verify_report, verify_build

    for option, value in (("--rtol", args.rtol), ("--atol", args.atol)):
        if not (math.isfinite(value) and value >= 0):
            from fxpipe.errors import ConfigError

            raise ConfigError(f"{option} must be a finite number >= 0, got {value}")
    from fxpipe.tracer.progress import phase

    if args.schedule is not None and not args.compile:
        from fxpipe.errors import ConfigError

        raise ConfigError("--schedule chooses how --compile compiles the stages; add --compile")
    _enter("verifying")
    if not args.compile:
        with phase("check"):
            report = verify_build(args.build_dir, rtol=args.rtol, atol=args.atol)
        print_verify_report(report, console=_console(), all_rows=args.all)
        return 0 if report.ok else 1
    from fxpipe.runtime.pipeline.compiled_verify import verify_compiled

    with phase("compile and check"):
        report, compiled = verify_compiled(
            args.build_dir,
            args.compile_scope,
            args.compile_backward,
            args.rtol,
            args.atol,
            args.schedule,
        )
    for stage in compiled:
        print(f"fxpipe verify: {stage.line(timed=False)}")
    print_verify_report(report, console=_console(), all_rows=args.all)
    if not report.ok:
        print(
            f"fxpipe verify: the compiled stages differ from the model; if `fxpipe verify "
            f"{args.build_dir}` (eager) agrees, the compiler computes something else for this "
            "model: train it without --compile (docs/compile.md)"
        )
    return 0 if report.ok else 1


def cmd_run(args: argparse.Namespace) -> int:
    from fxpipe.runtime.launch.launcher import become_launcher, run_build
    from fxpipe.runtime.train.run_options import explicit_fields, run_options_from_args

    become_launcher()  # Ctrl-C stops the job however this process was started (launch.py, Note [Ctrl-C])
    _enter("launching")
    run_build(
        args.build_dir,
        run_options_from_args(args),
        debug=args.debug,
        explicit=explicit_fields(args),
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from fxpipe.runtime.train.checkpoint import (
        checkpoint_meta,
        export_checkpoint,
        gather_state_dict,
    )
    from fxpipe.runtime.train.checkpoint_options import ExportOptions

    options = from_namespace(ExportOptions, args)
    _enter("exporting the checkpoint")
    state = export_checkpoint(args.checkpoint_dir, args.out)
    print(f"wrote {shown(args.out)}: {len(state)} tensors under the original model's keys")
    if options.pretrained is not None:  # Note [exporting a transformers model]
        from fxpipe.runtime.train.export_pretrained import export_pretrained

        _enter("writing save_pretrained's layout")
        files = export_pretrained(
            args.checkpoint_dir,
            gather_state_dict(args.checkpoint_dir),
            options.pretrained,
            checkpoint_meta(args.checkpoint_dir),
            options.model,
        )
        print(f"wrote {shown(options.pretrained)}: {', '.join(files)} (from_pretrained loads it)")
    return 0


def cmd_checkpoint_convert(args: argparse.Namespace) -> int:
    from fxpipe.runtime.train.checkpoint_options import ConvertOptions
    from fxpipe.runtime.train.convert import convert_checkpoint

    options = from_namespace(ConvertOptions, args)
    _enter("converting the checkpoint")
    note = convert_checkpoint(args.old, args.new, options.build)
    print(f"wrote {shown(args.new)}: {note}")
    return 0


# -- entry point ---------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose errors are one line (no usage dump) that names the verb an option belongs to
    when it was given to another (``partition --optimizer adamw``: ``fxpipe run`` trains with AdamW)."""

    verbs: dict[str, argparse.ArgumentParser] = {}

    def error(self, message: str) -> typing.NoReturn:
        self.exit(
            2,
            one_line(
                f"error: {self.prog}: {_elsewhere(self, message) or message}; "
                f"see `{self.prog} --help`"
            )
            + "\n",
        )


def _help(parser: argparse.ArgumentParser, flag: str) -> str:
    action = parser._option_string_actions[flag]
    return (action.help or "").split(" (default")[0] % {
        "choices": ", ".join(map(str, action.choices or ()))
    }


def _elsewhere(parser: argparse.ArgumentParser, message: str) -> str | None:
    """The error for a flag (and value) that ``parser`` refuses and another verb takes; ``None`` if none does."""
    choice = re.match(r"argument (\S+?)(?:/\S+)?: invalid choice: '([^']*)'", message)
    if choice:
        wanted: list[tuple[str, str | None]] = [(choice.group(1), choice.group(2))]
    elif message.startswith("unrecognized arguments: "):
        wanted = [
            (word.split("=")[0], None) for word in message.split()[2:] if word.startswith("-")
        ]
    else:
        return None
    for flag, value in wanted:
        for other in _Parser.verbs.values():
            action = other._option_string_actions.get(flag)
            if (
                other is parser
                or action is None
                or not (value is None or action.choices is None or value in action.choices)
            ):
                continue
            given = flag if value is None else f"{flag} {value}"
            text = f"`{given}` is an option of `{other.prog}` ({_help(other, flag)})"
            if flag in parser._option_string_actions:
                text += f"; here {flag} is the {_help(parser, flag)}"
            return text
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="fxpipe",
        description="Ahead-of-time pipeline-parallel compiler for PyTorch.",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks for errors")
    sub = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    p = sub.add_parser("trace", help="trace and profile a model file; write profile.json")
    _add_model_options(p)
    p.add_argument("--batch-size", type=int, default=2, help="batch size to trace at (default 2)")
    p.add_argument(
        "--out", default="profile.json", help="where to write the profile (default profile.json)"
    )
    p.set_defaults(func=cmd_trace)

    p = sub.add_parser("plan", help="plan stages from a saved profile.json; write plan.json")
    p.add_argument("profile", help="profile.json written by `fxpipe trace`")
    add_arguments(p, PlanOptions)
    add_cluster_arguments(p)
    p.add_argument("--out", default="plan.json", help="where to write the plan (default plan.json)")
    p.add_argument(
        "--html", metavar="PATH", help="also write the self-contained HTML report to PATH"
    )
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("partition", help="trace + plan + emit the build directory")
    _add_model_options(p)
    add_arguments(p, PlanOptions)
    add_cluster_arguments(p)
    p.add_argument(
        "--batch-size",
        type=int,
        default=None,
        help="batch of one pipeline replica per step (default 2 x microbatches)",
    )
    p.add_argument("--out", default="build", help="the build directory to write (default build)")
    p.add_argument(
        "--no-check",
        action="store_true",
        help="write the build without first checking, in this process, that the stages equal the model "
        "in train and eval mode (the check holds the model's weights twice)",
    )
    p.add_argument(
        "--weights",
        metavar="PATH",
        default=None,
        help="with --device meta: the checkpoint each stage's weights are read from (a .safetensors "
        "file, a directory of safetensors shards with an index JSON, a torch.save'd state dict, or "
        "the --checkpoint-dir of an fxpipe run); "
        "without it a meta build writes no parameters and each stage initialises itself at load",
    )
    p.set_defaults(func=cmd_partition)

    p = sub.add_parser(
        "report", help="print a build directory's plan again (beside run.json's measurements)"
    )
    p.add_argument("build_dir", help="a build directory written by `fxpipe partition`")
    p.add_argument("--html", action="store_true", help="(re)write report.html")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser(
        "verify",
        help="check the stages against the original model in one process, in train and eval mode",
    )
    p.add_argument("build_dir", help="a build directory written by `fxpipe partition`")
    p.add_argument(
        "--rtol",
        type=float,
        default=1e-4,
        help="relative tolerance, times each tensor's largest magnitude (default 1e-4)",
    )
    p.add_argument(
        "--atol", type=float, default=1e-5, help="absolute tolerance added to it (default 1e-5)"
    )
    p.add_argument(
        "--all",
        action="store_true",
        help="list every output, gradient and buffer (default: the worst)",
    )
    from fxpipe.runtime.train.run_options import RunOptions

    add_arguments(  # the stages as `fxpipe run --compile` runs them (compiled_verify)
        p,
        RunOptions,
        title="compiled stages",
        only=("compile", "compile_scope", "compile_backward", "schedule"),
    )
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser(
        "run", help="train the build with torchrun, one process per stage and replica"
    )
    p.add_argument("build_dir", help="a build directory written by `fxpipe partition`")
    from fxpipe.runtime.train.run_options import (
        add_run_arguments,
    )  # the flags the worker entry point reads too

    add_run_arguments(p)
    p.set_defaults(func=cmd_run)

    p = sub.add_parser(
        "export", help="gather a training checkpoint's stages into one safetensors state dict"
    )
    p.add_argument("checkpoint_dir", help="a --checkpoint-dir of `fxpipe run`")
    p.add_argument(
        "--out", default="model.safetensors", help="the file to write (default model.safetensors)"
    )
    from fxpipe.runtime.train.checkpoint_options import ConvertOptions, ExportOptions

    add_arguments(p, ExportOptions)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("checkpoint", help="work on a training checkpoint without starting a job")
    tools = p.add_subparsers(dest="tool", required=True, metavar="TOOL")
    p = tools.add_parser(
        "convert",
        help="convert a per-rank checkpoint (rank_<r>.pt, older fxpipe) into the model-keyed format "
        "once, so that any layout resumes it",
    )
    p.add_argument("old", help="the --checkpoint-dir holding the per-rank files")
    p.add_argument("new", help="the new directory to write the model-keyed checkpoint into")
    add_arguments(p, ConvertOptions)
    p.set_defaults(func=cmd_checkpoint_convert)
    _Parser.verbs = dict(sub.choices)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    _standard_streams()
    parser = build_parser()
    try:
        args, extra = parser.parse_known_args(argv)
    except FxpipeError as exc:  # a flag's own parser (--betas 0.9, --memory-limit lots)
        print_safely(one_line(f"error: {exc}"))
        return exc.exit_code
    if extra:
        _Parser.verbs[args.verb].error(f"unrecognized arguments: {' '.join(extra)}")
    _enter(f"running `fxpipe {args.verb}`")
    try:
        from fxpipe.tracer.progress import reporting

        # the long phases: progress on a terminal, else one line each on stdout (stderr keeps only errors);
        # a model's os._exit() is an error, never a silent exit 0 (Note [os._exit in user code])
        with reporting(sys.stderr, lines=sys.stdout), exits_raise():
            return int(args.func(args) or 0)
    except FxpipeError as exc:
        if args.debug:
            raise
        print_safely(f"error: {exc if exc.multiline else one_line(str(exc))}")
        return exc.exit_code
    except KeyboardInterrupt:
        print_safely("error: interrupted")
        return 130
    except SignalStop as exc:  # fxpipe run: Note [stopping fxpipe run]
        print_safely(f"error: {exc}; the job and its temporary files were removed")
        return 128 + exc.signum
    except BrokenPipeError:
        return _output_closed()
    except (
        BaseException
    ) as exc:  # a bug, or SystemExit from a model file: one line, never a traceback
        if args.debug:
            raise
        print_safely(f"error: {one_line(internal_error_line(exc, _PHASE[0]))}")
        return 2


def _standard_streams() -> None:
    """A standard stream that was closed before the process started (``fxpipe verify build >&-``) is ``None``
    in Python: point it at /dev/null, so that the verb still runs and its exit code still says the result."""
    for name in ("stdout", "stderr"):
        if getattr(sys, name) is None:
            setattr(sys, name, open(os.devnull, "w", encoding="utf-8"))  # noqa: SIM115 - for the process's life


def _output_closed() -> int:
    """Standard output was closed by its reader (``fxpipe … | head``): stop without a word, and point
    stdout at /dev/null so the interpreter's final flush cannot complain either."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # not a real file (e.g. captured by a test)
        pass
    return 128 + 13  # as if killed by SIGPIPE


if __name__ == "__main__":
    raise SystemExit(main())
