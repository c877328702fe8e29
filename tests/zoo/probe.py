"""Probe the conformance zoo with today's fxpipe: what traces, partitions and matches, in which mode.

For every zoo model (``tests/zoo/registry.py``), each step recorded as ok / error / mismatch:

* ``build``: import the model file, build the model, run it once eagerly;
* ``trace``: ``trace_model_file`` with the ``auto`` front end (``--frontend`` picks another) at
  microbatch 2 (front end, units, seconds);
* ``partition@S`` for S = 2 and 4: plan (``plan_partition``, the CLI's loopback cost model, S
  microbatches of 2, so batch 2S, as ``fxpipe partition --stages S`` does) and ``write_build_dir``;
* ``train@S`` / ``eval@S``: the chained stages (``fxpipe.load_pipeline``) against ``build_model()``
  given the build's weights, both in train mode, then both in ``.eval()``: outputs, parameter
  gradients and buffers, fp32, rtol 1e-4 / atol 1e-5 (``tests/zoo/compare.py``);
* ``compiled@S`` (``--compile``, the first S): ``train@S`` then ``eval@S`` with every stage
  compiled as a zero-bubble run compiles it, the backward cut into an input and a weight half,
  dropout drawing eager's numbers (``compare.compare_compiled``); graph breaks and halves that
  fell back to one graph are in the row's JSON;
* ``kwargs`` / ``labels``: the same trace + partition@2 + train compare with the model file's
  ``example_kwargs`` (a dict: the Hugging Face keyword call) and ``example_kwargs_labels``
  (``labels=`` too; the loss is the model's own ``output.loss``), the contract issue 10 asks for.

A failing step is a row, never a crash of the probe; a step after a failed one it needs is
``-`` (skipped). ``--isolate`` runs each model in its own process with a time limit, so even a
hang or a crash of the interpreter is one row.

Usage::

    PYTHONPATH=$PWD .venv/bin/python tests/zoo/probe.py                    # every model
    PYTHONPATH=$PWD .venv/bin/python tests/zoo/probe.py llama resnet --json out.json
    PYTHONPATH=$PWD .venv/bin/python tests/zoo/probe.py --isolate --timeout 300
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from registry import ZooModel, select  # noqa: E402

MICROBATCH = 2
STAGES = (2, 4)
PLAN_TIME_LIMIT = (
    2.0  # CP-SAT seconds per plan (the CLI's default is 10; plan quality does not matter here)
)
QUIET_WARNINGS = (DeprecationWarning, FutureWarning, PendingDeprecationWarning)


# ---- recording a step ---------------------------------------------------------------------------------------------


def _short(path: str) -> str:
    """A frame's file relative to the checkout or to site-packages."""
    for marker in ("/site-packages/", "/work/wt/", "/work/main/"):
        if marker in path:
            rest = path.split(marker, 1)[1]
            return rest.split("/", 1)[1] if marker.startswith("/work/") and "/" in rest else rest
    return path


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return " ".join(text[0].split())[:300] if text else ""


def describe_error(exc: BaseException) -> dict[str, Any]:
    """Type, first line, the innermost fxpipe frame, the innermost frame, and the same for the root cause."""
    frames = traceback.extract_tb(exc.__traceback__)
    ours = [f for f in frames if "/fxpipe/" in f.filename and "/tests/" not in f.filename]
    out: dict[str, Any] = {
        "error_type": type(exc).__name__,
        "error": _first_line(exc),
        "at": f"{_short(ours[-1].filename)}:{ours[-1].name}:{ours[-1].lineno}" if ours else "",
        "origin": f"{_short(frames[-1].filename)}:{frames[-1].name}:{frames[-1].lineno}"
        if frames
        else "",
    }
    cause = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    seen = 0
    while cause is not None and (cause.__cause__ or cause.__context__) is not None and seen < 10:
        cause, seen = cause.__cause__ or cause.__context__, seen + 1
    if cause is not None:
        cframes = traceback.extract_tb(cause.__traceback__)
        cours = [f for f in cframes if "/fxpipe/" in f.filename and "/tests/" not in f.filename]
        out["cause"] = (
            f"{type(cause).__name__}: {_first_line(cause)}"
            + (
                f" @ {_short(cours[-1].filename)}:{cours[-1].name}:{cours[-1].lineno}"
                if cours
                else ""
            )
            + (
                f" (innermost {_short(cframes[-1].filename)}:{cframes[-1].name}:{cframes[-1].lineno})"
                if cframes
                else ""
            )
        )
    return out


@dataclass
class Step:
    """One step's outcome: ``status`` is ok, mismatch (ran, numbers differ), error or skipped."""

    status: str = "skipped"
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "seconds": round(self.seconds, 2), **self.info}


def run_step(fn: Callable[[], Any]) -> tuple[Step, Any]:
    """Run ``fn``; any exception becomes an error step. Warnings (other than deprecations) are kept."""
    start = time.perf_counter()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            value = fn()
            step = Step("ok")
        except Exception as exc:  # noqa: BLE001 - every failure is a row of the table
            value, step = None, Step("error", info=describe_error(exc))
    step.seconds = time.perf_counter() - start
    messages: list[str] = []
    for w in caught:
        if issubclass(w.category, QUIET_WARNINGS):
            continue
        text = " ".join(str(w.message).split())[:240]
        if text not in messages:
            messages.append(text)
    if messages:
        step.info["warnings"] = messages[:6]
    return step, value


# ---- the probe of one model ---------------------------------------------------------------------------------------

FRONTEND = "auto"  # --frontend changes it (the CLI's default is auto)


def _trace(source: Any) -> Any:
    from fxpipe.tracer import trace_model_file

    return trace_model_file(source, MICROBATCH, frontend=FRONTEND, progress=False)


def _partition(traced: Any, source: Any, stages: int, out: Path) -> Any:
    from fxpipe.codegen import write_build_dir
    from fxpipe.partitioner import CostModel, plan_partition

    plan = plan_partition(
        traced.profile,
        stages,
        microbatches=stages,
        time_limit=PLAN_TIME_LIMIT,
        cost=CostModel.preset("loopback", optimizer="sgd"),
    )
    write_build_dir(traced, plan, out, source, batch_size=MICROBATCH * stages, microbatches=stages)
    return plan


def _checked(fn: Callable[[], Any]) -> Step:
    """A step whose value is a ``Comparison``: ok or mismatch by its verdict, with its numbers."""
    step, result = run_step(fn)
    if result is not None:
        step.info.update(result.to_dict())
        step.status = "ok" if result.ok else "mismatch"
    return step


def _eager(source: Any) -> Any:
    import torch

    model = source.build_model()
    with torch.no_grad():
        source.example_call(MICROBATCH)(model)
    return model


def _keyword_path(model: ZooModel, inputs_fn: str, workdir: Path) -> Step:
    """Trace, partition at 2 and compare in train mode with keyword inputs (a dict from ``inputs_fn``)."""
    from compare import compare_pipeline
    from fxpipe.modelfile import load_model_file

    def go() -> Any:
        source = load_model_file(model.spec, inputs_fn=inputs_fn)
        _partition(_trace(source), source, 2, workdir / f"{inputs_fn}_s2")
        return compare_pipeline(workdir / f"{inputs_fn}_s2", source, True)

    return _checked(go)


RANK_ERROR = re.compile(r"^\[rank(\d+)\]: ([A-Za-z_.]*(?:Error|Exception|Interrupt)): (.*)$")
RANK_FRAME = re.compile(r'^\[rank(\d+)\]:\s+File "([^"]+)", line (\d+), in (\S+)')


def _run_build(build: Path, steps: int = 2, timeout: float = 180.0) -> Step:
    """``fxpipe run BUILD --steps 2`` (torchrun, one process per stage): trains or not, and the errors it shows.

    ``error`` is the line the user sees (``error: ...``); ``cause`` the first exception a rank raised.
    """
    start = time.perf_counter()
    cmd = [
        sys.executable,
        "-m",
        "fxpipe",
        "run",
        str(build),
        "--steps",
        str(steps),
        "--timeout",
        "60",
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return Step(
            "error",
            time.perf_counter() - start,
            {"error_type": "Timeout", "error": f"over {timeout:g} s"},
        )
    seconds = time.perf_counter() - start
    if proc.returncode == 0 and (build / "run.json").is_file():
        losses = json.loads((build / "run.json").read_text()).get("losses", [])
        return Step("ok", seconds, {"losses": losses})
    lines = (proc.stderr + proc.stdout).splitlines()
    shown = [ln for ln in lines if ln.startswith("error:")] or lines[-1:] or [""]
    info: dict[str, Any] = {
        "error_type": "RunFailed",
        "error": shown[0][:300],
        "exit": proc.returncode,
    }
    cause = next((m for m in map(RANK_ERROR.match, lines) if m), None)
    if cause is not None:  # the first exception a rank printed, and its innermost fxpipe frame
        rank, etype, message = cause.groups()
        info["error_type"] = etype.rsplit(".", 1)[-1]
        info["cause"] = f"rank {rank}: {etype}: {message[:240]}"
        frames = [
            m
            for m in map(RANK_FRAME.match, lines)
            if m and m.group(1) == rank and "/fxpipe/" in m.group(2)
        ]
        if frames:
            _, path, line, func = frames[-1].groups()
            info["at"] = f"{_short(path)}:{func}:{line}"
    return Step("error", seconds, info)


def _compiled_step(build: Path, source: Any) -> Step:
    """``compiled@S``: the chained stages, each compiled with its backward in halves, against the
    original in train mode, then in eval mode on the same stages (``compare.compare_compiled``;
    the step's numbers are the first mode that fails, else train's); the graph breaks and any
    halves that fell back to one graph go in the step's info."""
    from compare import compare_compiled

    extra: dict[str, Any] = {}

    def go() -> Any:
        got = compare_compiled(build, source, eval=True)
        extra.update(breaks=got.breaks, halves_ran=got.halves_ran, one_graph=got.split_failures)
        failed_in_eval = got.comparison.ok and got.eval is not None and not got.eval.ok
        return got.eval if failed_in_eval else got.comparison

    step = _checked(go)
    step.info.update(extra)
    return step


def probe_model(
    model: ZooModel,
    workdir: Path,
    stages: tuple[int, ...] = STAGES,
    train_run: bool = False,
    keywords: bool = True,
    compiled: bool = False,
) -> dict[str, Any]:
    """Every step of one model (see the module docstring; the keyword calls only with ``keywords``,
    ``compiled@S`` only with ``compiled``); the row of the table as a dict."""
    import torch

    from compare import compare_pipeline
    from fxpipe.modelfile import load_model_file

    torch.manual_seed(0)
    start = time.perf_counter()
    steps: dict[str, Step] = {}
    row: dict[str, Any] = {**model.to_dict()}
    steps["build"], source = run_step(lambda: load_model_file(model.spec))
    if source is not None:
        steps["build"], _ = run_step(lambda: _eager(source))
    traced = None
    if steps["build"].status == "ok":
        steps["trace"], traced = run_step(lambda: _trace(source))
    if traced is not None:
        row["frontend"] = traced.frontend
        row["units"] = len(traced.profile.units)
        kept = [
            f"{path} ({cls.__name__})"
            for path, cls in traced.leaf_modules.items()
            if not cls.__module__.startswith("torch.nn")
        ]
        if kept:  # modules the symbolic front end kept whole (not standard torch.nn layers)
            row["kept_whole"] = kept
    for s in stages:
        build = workdir / f"s{s}"
        if traced is not None:
            steps[f"partition@{s}"], _ = run_step(lambda: _partition(traced, source, s, build))
        if steps.get(f"partition@{s}", Step()).status == "ok":
            steps[f"train@{s}"] = _checked(lambda: compare_pipeline(build, source, True))
            steps[f"eval@{s}"] = _checked(lambda: compare_pipeline(build, source, False))
    if compiled and steps.get(f"partition@{stages[0]}", Step()).status == "ok":
        steps[f"compiled@{stages[0]}"] = _compiled_step(workdir / f"s{stages[0]}", source)
    if train_run and steps.get(f"partition@{stages[0]}", Step()).status == "ok":
        steps["run"] = _run_build(workdir / f"s{stages[0]}")
    if keywords and model.has_kwargs:
        steps["kwargs"] = _keyword_path(model, "example_kwargs", workdir)
        steps["labels"] = _keyword_path(model, "example_kwargs_labels", workdir)
    row["steps"] = {k: v.to_dict() for k, v in steps.items()}
    row["seconds"] = round(time.perf_counter() - start, 1)
    return row


def probe_isolated(
    model: ZooModel,
    timeout: float,
    stages: tuple[int, ...],
    train_run: bool,
    compiled: bool = False,
) -> dict[str, Any]:
    """``probe_model`` in a child process: a hang or a crash of the interpreter is one row."""
    with tempfile.TemporaryDirectory(prefix="zoo-probe-") as tmp:
        out = Path(tmp) / "row.json"
        cmd = (
            [
                sys.executable,
                str(Path(__file__).resolve()),
                model.name,
                "--json",
                str(out),
                "--quiet",
                "--frontend",
                FRONTEND,
                "--stages",
                ",".join(map(str, stages)),
            ]
            + (["--run"] if train_run else [])
            + (["--compile"] if compiled else [])
        )
        start = time.perf_counter()
        try:
            proc = subprocess.run(
                cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy()
            )
        except subprocess.TimeoutExpired:
            problem = {
                "error_type": "Timeout",
                "error": f"the probe of {model.name} ran over {timeout:g} s",
            }
        else:
            if proc.returncode == 0 and out.is_file():
                return json.loads(out.read_text())["rows"][0]
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""]
            problem = {
                "error_type": "ProcessDied",
                "error": f"exit status {proc.returncode}: {tail[0][:240]}",
            }
    return {
        **model.to_dict(),
        "seconds": round(time.perf_counter() - start, 1),
        "steps": {"process": {"status": "error", **problem}},
    }


# ---- the table ----------------------------------------------------------------------------------------------------

COLUMNS = [
    "build",
    "trace",
    "partition@2",
    "train@2",
    "eval@2",
    "partition@4",
    "train@4",
    "eval@4",
    "kwargs",
    "labels",
    "compiled@2",
    "run",
]


def _cell(step: dict[str, Any] | None) -> str:
    if step is None:
        return "-"
    status = step["status"]
    if status == "ok":
        if "max_abs" in step:
            return "ok 0" if step["max_abs"] == 0 else f"ok {step['max_abs']:.0e}"
        return "ok"
    if status == "mismatch":
        return f"DIFF {step['max_abs']:.2g}"
    if status == "error":
        return f"ERR {step['error_type']}"
    return "-"


def table_lines(rows: list[dict[str, Any]]) -> list[str]:
    """A markdown table: one row per model, one column per step, then seconds."""
    header = ["model", "front end", "units"] + COLUMNS + ["s"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        cells = [
            r["name"] + (" *" if r.get("dropout") else ""),
            r.get("frontend", "-"),
            str(r.get("units", "-")),
        ]
        cells += [_cell(r["steps"].get(c)) for c in COLUMNS]
        if "process" in r["steps"]:
            cells[3] = _cell(r["steps"]["process"])
        cells.append(f"{r['seconds']:.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def failure_groups(rows: list[dict[str, Any]]) -> list[str]:
    """Failures grouped by (step kind, error type, innermost fxpipe frame): the team's work list.

    Each group shows the first line of its first error (and its root cause, when the error
    wraps another); a mismatch group lists each model with the tensor furthest off.
    """
    groups: dict[tuple[str, str, str], list[tuple[str, dict[str, Any]]]] = {}
    for r in rows:
        for name, step in r["steps"].items():
            kind = name.split("@")[0]
            if step["status"] == "error":
                key = (kind, step["error_type"], step.get("at") or step.get("origin", ""))
            elif step["status"] == "mismatch":
                key = (kind, "mismatch", "")
            else:
                continue
            label = f"{r['name']}@{name.split('@')[1]}" if "@" in name else r["name"]
            groups.setdefault(key, []).append((label, step))
    lines = []
    for (kind, etype, where), members in sorted(
        groups.items(), key=lambda kv: (-len(kv[1]), kv[0])
    ):
        labels = ", ".join(label for label, _ in members)
        lines.append(
            f"- {kind}: {etype}{f' at {where}' if where else ''} ({len(members)}): {labels}"
        )
        first = members[0][1]
        if etype == "mismatch":
            lines += [
                f"    {label}: {step['worst']} off by {step['max_abs']:.3g} ({step['failing']} tensors)"
                for label, step in members
            ]
            continue
        lines.append(f"    {first['error']}")
        if first.get("cause"):
            lines.append(f"    cause: {first['cause']}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="zoo models to probe (default: all)")
    parser.add_argument("--json", help="write the rows (and machine metadata) to this file")
    parser.add_argument(
        "--stages", default=",".join(map(str, STAGES)), help="stage counts (default 2,4)"
    )
    parser.add_argument(
        "--isolate", action="store_true", help="probe each model in its own process"
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per model with --isolate"
    )
    parser.add_argument(
        "--run",
        action="store_true",
        help="also train the 2-stage build with `fxpipe run --steps 2` (torchrun; ~20 s a model)",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="also compare the 2-stage build with each stage compiled, backward in halves (issue 39)",
    )
    parser.add_argument("--keep", help="keep the build directories under this folder")
    parser.add_argument(
        "--frontend",
        choices=["auto", "symbolic", "export"],
        default="auto",
        help="tracing front end (default auto, as the CLI)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="print nothing (for --isolate's children)"
    )
    args = parser.parse_args(argv)
    stages = tuple(int(s) for s in args.stages.split(","))
    global FRONTEND
    FRONTEND = args.frontend
    try:
        models = select(args.names)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    rows = []
    start = time.perf_counter()
    for model in models:
        if args.isolate:
            row = probe_isolated(model, args.timeout, stages, args.run, args.compile)
        else:
            with tempfile.TemporaryDirectory(prefix=f"zoo-{model.name}-") as tmp:
                workdir = Path(args.keep) / model.name if args.keep else Path(tmp)
                row = probe_model(model, workdir, stages, args.run, compiled=args.compile)
        rows.append(row)
        if not args.quiet:
            print(table_lines([row])[-1], flush=True)
    total = time.perf_counter() - start
    if args.json:
        import torch

        try:
            import transformers

            tf_version = transformers.__version__
        except ImportError:
            tf_version = None
        meta = {
            "torch": torch.__version__,
            "transformers": tf_version,
            "python": platform.python_version(),
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "seconds": round(total, 1),
            "microbatch": MICROBATCH,
            "stages": stages,
            "frontend": FRONTEND,
            "rtol": 1e-4,
            "atol": 1e-5,
        }
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    if not args.quiet:
        print()
        print("\n".join(table_lines(rows)))
        print("\n(* = dropout or stochastic depth; ok/DIFF = max abs error; ERR = exception type)")
        print(f"\nfailures by root cause ({total:.0f} s in all):")
        print("\n".join(failure_groups(rows)) or "none")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
