"""Where a pipeline step's time goes, per rank: each action kind's compute, and what is not compute.

    .venv/bin/python benchmarks/runtime/profile_step.py [--schedule zbv] [--steps 20] [--eager]
        [--cprofile 0] [--build DIR] [--out DIR]

The build is bench_compiled.py's (gpt_medium, batch 16 = 4 x 4, 2 ranks, gloo, one thread per
rank, analytic plan); the runner compiles its stages (``compile="stage"``) unless ``--eager``.
After 3 untimed steps, ``--steps`` steps, each between two barriers. Timers wrap (without changing
what runs) each action of ``StageWorker`` (``F``/``B``/``W``), inside them the stage module's
forward, the autograd engine calls (``B``'s ``autograd.grad``, ``W``'s ``autograd.backward``),
inductor's compiled graphs (``CompiledFxGraph.__call__``: the kernels and inductor's own wrapper),
the sends, the split backward's ``B`` half and the shape check; outside the actions the receives'
posting and waits, the batch check, ``zero_grad`` and the optimizer step; and Python's garbage
collections. Per rank it prints each timer's median per step (ms; a label ``K: name`` is time
inside actions of kind ``K``, ``-:`` outside any action), where:

- ``K: rest``: the action's time less its stage compute (module forward and loss for ``F``, the
  autograd calls for ``B`` and ``W``) and its sends: fxpipe's own Python per action;
- ``stage module forward`` less ``inductor graphs`` (in ``F``): torch.compile's runtime
  wrappers (Dynamo's guards, AOTAutograd's wrapper), likewise ``autograd.*`` less graphs;
- ``outside actions``: the step less its actions (waits for receives, posting them, the batch
  check, the optimizer).

It also prints, per rank, the median over steps of the idle gap before each action (waiting for
its receives). ``--cprofile N`` then runs N steps under cProfile and writes the top functions per
rank to ``OUT/profile-rank{r}.txt`` (and ``.pstats``). Nothing here changes what a step computes.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
MODEL = HERE / "gpt_medium.py"
RANKS, BATCH, M, LR = 2, 16, 4, 0.01


def _build(root: Path, schedule: str) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    source = load_model_file(MODEL)
    traced = trace_model_file(source, BATCH // M, progress=False)
    plan = plan_partition(traced.profile, RANKS, microbatches=M, schedule=schedule)
    write_build_dir(traced, plan, root / schedule, source, batch_size=BATCH, microbatches=M)


class _Timers:
    """Seconds spent in wrapped calls since the last ``take()``, by name and by the kind of the
    action they ran in (the innermost wrapped worker action; ``-`` outside any)."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.kind = "-"

    def wrap(
        self, name: str, fn: Callable[..., Any], kind: str | None = None
    ) -> Callable[..., Any]:
        spent = self.spent

        def timed(*args: Any, **kwargs: Any) -> Any:
            outer = self.kind
            if kind is not None:
                self.kind = kind
            label = name if kind is not None else f"{self.kind}: {name}"
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - t0
                self.kind = outer

        return timed

    def take(self) -> dict[str, float]:
        got = dict(self.spent)
        self.spent.clear()
        return got


def _instrument(fx: Any, timers: _Timers) -> Callable[[], None]:
    """Wrap the runner's parts in timers; the call that takes the global wrappers off again."""
    comm = fx.executor.comm
    comm.p2p.wait = timers.wrap("receive wait", comm.p2p.wait)
    comm.send = timers.wrap("sends", comm.send)
    comm.finish = timers.wrap("step: wait for sends", comm.finish)
    for worker in fx.executor.workers.values():
        for kind, method in (("F", "forward"), ("B", "backward"), ("W", "weight")):
            setattr(worker, method, timers.wrap(f"{kind}: action", getattr(worker, method), kind))
        for method in ("_check_outputs", "post_forward", "post_backward"):
            setattr(worker, method, timers.wrap(method, getattr(worker, method)))
        worker._split.inputs = timers.wrap("split backward B", worker._split.inputs)
    fx._check_batch = timers.wrap("step: batch check", fx._check_batch)
    if fx.optimizer is not None:
        fx.optimizer.zero_grad = timers.wrap("step: zero_grad", fx.optimizer.zero_grad)
        fx.optimizer.step = timers.wrap("step: optimizer", fx.optimizer.step)
    for module in fx.stages.values():
        module.forward = timers.wrap("stage module forward", module.forward)
    from torch._inductor.output_code import CompiledFxGraph

    grad, backward, graph_call = (
        torch.autograd.grad,
        torch.autograd.backward,
        CompiledFxGraph.__call__,
    )
    torch.autograd.grad = timers.wrap("autograd.grad", grad)
    torch.autograd.backward = timers.wrap("autograd.backward", backward)
    CompiledFxGraph.__call__ = timers.wrap("inductor graphs", graph_call)  # type: ignore[method-assign]
    started: list[float] = []

    def on_gc(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            timers.spent[f"gc gen{info['generation']}"] += time.perf_counter() - started.pop()

    gc.callbacks.append(on_gc)

    def undo() -> None:
        torch.autograd.grad, torch.autograd.backward = grad, backward
        CompiledFxGraph.__call__ = graph_call  # type: ignore[method-assign]
        gc.callbacks.remove(on_gc)

    return undo


def _row(step: float, spent: dict[str, float], actions: list[Any]) -> dict[str, float]:
    row = {"step": step, **spent}
    for a in actions:
        k = a.action.kind.value
        row[k] = row.get(k, 0.0) + a.end - a.start
    row["actions"] = sum(row.get(k, 0.0) for k in "FBW")
    row["outside actions"] = step - row["actions"]
    for k in "FBW":
        compute = row.get(f"{k}: autograd.grad", 0.0) + row.get(f"{k}: autograd.backward", 0.0)
        if k == "F":
            compute += row.get("F: stage module forward", 0.0) + row.get("-: loss_fn", 0.0)
        row[f"{k}: rest"] = row.get(k, 0.0) - compute - row.get(f"{k}: sends", 0.0)
    return row


def _worker(root: Path, schedule: str, steps: int, prof_steps: int, eager: bool, out: Path) -> None:
    import torch.distributed as dist

    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source = load_model_file(MODEL)
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    timers = _Timers()
    fx = PipelineRunner(
        root / schedule,
        timers.wrap("loss_fn", source.loss_fn),
        microbatches=M,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        compile=False if eager else "stage",
        compile_cache=root / "cache",
        timeout_s=1800,
    )
    undo = _instrument(fx, timers)
    for _ in range(3):
        fx.step(inputs, targets)
    rows, timelines = [], []
    for _ in range(steps):
        dist.barrier()
        timers.take()
        t0 = time.perf_counter()
        fx.step(inputs, targets)
        t1 = time.perf_counter()
        dist.barrier()
        rows.append(_row(t1 - t0, timers.take(), fx.executor.last_step))
        timelines.append(
            [
                (
                    f"{a.action.kind.value}{a.action.stage}.{a.action.microbatch}",
                    a.start - t0,
                    a.end - t0,
                )
                for a in fx.executor.last_step
            ]
        )
    undo()
    if prof_steps:
        prof = cProfile.Profile()
        for _ in range(prof_steps):
            dist.barrier()
            prof.enable()
            fx.step(inputs, targets)
            prof.disable()
            dist.barrier()
        prof.dump_stats(str(out / f"profile-rank{rank}.pstats"))
        text = io.StringIO()
        st = pstats.Stats(prof, stream=text)
        st.sort_stats("tottime").print_stats(45)
        st.sort_stats("cumulative").print_stats(60)
        (out / f"profile-rank{rank}.txt").write_text(text.getvalue())
    keys = sorted({k for r in rows for k in r})
    summary = {k: statistics.median(r.get(k, 0.0) for r in rows) for k in keys}
    summary["step min"] = min(r["step"] for r in rows)
    summary["step max"] = max(r["step"] for r in rows)
    gaps = {
        name: statistics.median(tl[i][1] - (tl[i - 1][2] if i else 0.0) for tl in timelines)
        for i, (name, _, _) in enumerate(timelines[0])
    }
    (out / f"summary-rank{rank}.json").write_text(json.dumps({"ms": summary, "gaps": gaps}))
    dist.destroy_process_group()


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        _, _, root, schedule, steps, prof, eager, out = sys.argv
        _worker(Path(root), schedule, int(steps), int(prof), eager == "1", Path(out))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--schedule", default="zbv")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--cprofile", type=int, default=0, help="steps to run under cProfile after")
    p.add_argument("--eager", action="store_true", help="stages not compiled")
    p.add_argument(
        "--build",
        type=Path,
        default=None,
        metavar="ROOT",
        help="a folder whose ROOT/<schedule>/ build is profiled (written there when missing)",
    )
    p.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / "fxpipe-profile")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    from launch_ranks import torchrun

    args.out.mkdir(parents=True, exist_ok=True)
    root = args.build or Path(tempfile.mkdtemp())
    if not (root / args.schedule).exists():
        _build(root, args.schedule)
    subprocess.run(
        torchrun(
            __file__,
            RANKS,
            str(root),
            args.schedule,
            str(args.steps),
            str(args.cprofile),
            "1" if args.eager else "0",
            str(args.out),
        ),
        check=True,
    )
    for r in range(RANKS):
        got = json.loads((args.out / f"summary-rank{r}.json").read_text())
        print(f"rank {r}: ms per step, medians over {args.steps} steps")
        for k, v in got["ms"].items():
            print(f"  {k:28s} {v * 1e3:8.2f}")
        print(
            "  idle before each action (median ms): "
            + "  ".join(f"{name} {v * 1e3:.2f}" for name, v in got["gaps"].items())
        )


if __name__ == "__main__":
    main()
