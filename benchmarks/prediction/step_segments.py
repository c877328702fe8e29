"""Where a pipelined step's time goes, measured against what the prediction charges for each part.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/step_segments.py [--models gpt,gpt_medium]
        [--schedules gpipe,1f1b,zb-h1]
        [--steps 20] [--out benchmarks/prediction]

For each schedule it traces the model with measured unit times, plans 2 stages and runs 2
gloo ranks (one thread each, SGD) of ``PipelineRunner`` in this process's children, with
timers around the step's parts: before the first action (``zero_grad``, the microbatch
split), the actions themselves (compute after their receives arrived), the wait for the
last sends, the tied-gradient all-reduce, the loss broadcast and the optimizer step. Each
is the median over the timed steps, per rank, next to the prediction's figure for it
(``plan.prediction``: the simulated actions' busy time, ``StepOverheads``). The ratio of
the busiest rank's action time to the simulator's says how much slower compute runs inside
a running pipeline than in the profile's warm loop. Writes step_segments.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "gpt": (ROOT / "examples" / "gpt.py", 8, 4),
    "gpt_medium": (ROOT / "benchmarks" / "runtime" / "gpt_medium.py", 16, 4),
}
SEGMENTS = (
    "before first action",
    "actions (busy)",
    "last sends",
    "tied all-reduce",
    "loss broadcast",
    "optimizer step",
    "step",
)
COLLECTIVES = ("tied all-reduce", "loss broadcast")  # measured / predicted: the rank that came last


def _rank(rank: int, port: int, build: str, model_file: str, steps: int, out: Any) -> None:
    import torch
    import torch.distributed as dist

    import fxpipe.runtime.pipeline.runner as runner_module
    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    source = load_model_file(Path(model_file))
    plan = json.loads((Path(build) / "plan.json").read_text())
    M = plan["microbatches"]
    runner = PipelineRunner(
        build,
        source.loss_fn,
        microbatches=M,
        schedule=plan["schedule"],
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=0.01),
    )
    batch = M * plan["microbatch_size"]
    x, y = source.example_inputs(batch), source.example_targets(batch)
    timed: dict[str, float] = {}

    def wrap(owner: Any, name: str, label: str) -> None:
        inner = getattr(owner, name)

        def timer(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                timed[label] = timed.get(label, 0.0) + time.perf_counter() - t

        setattr(owner, name, timer)

    wrap(runner.executor.comm, "finish", "last sends")
    wrap(runner_module, "sync_tied_grads", "tied all-reduce")
    wrap(runner, "_shared_loss", "loss broadcast")
    if runner.optimizer is not None:
        wrap(runner.optimizer, "step", "optimizer step")
    for _ in range(3):
        runner.step(x, y)
    rows = []
    for _ in range(steps):
        timed.clear()
        t0 = time.perf_counter()
        runner.step(x, y)
        t1 = time.perf_counter()
        acts = runner.executor.last_step
        rows.append(
            {
                **timed,
                "step": t1 - t0,
                "before first action": acts[0].start - t0 if acts else 0.0,
                "actions (busy)": sum(a.end - a.start for a in acts),
            }
        )
    out.put((rank, {k: statistics.median(r.get(k, 0.0) for r in rows) * 1e3 for k in SEGMENTS}))
    dist.destroy_process_group()


def _measure(model: str, schedule: str, steps: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.runtime.launch.launcher import free_port
    from fxpipe.tracer import trace_model_file

    model_file, batch, micro = MODELS[model]
    source = load_model_file(model_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_model_file(source, batch // micro, progress=False, measure_times=True)
    plan = plan_partition(traced.profile, 2, schedule=schedule, microbatches=micro)
    build = Path(tempfile.mkdtemp(prefix="fxpipe-segments-"))
    write_build_dir(traced, plan, build, source, batch_size=batch, microbatches=micro)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_rank, args=(r, port, str(build), str(model_file), steps, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(60)
    pred = plan.prediction
    assert pred is not None
    from fxpipe.partitioner import build_problem
    from fxpipe.partitioner.prediction import RUNTIME_COSTS, simulate_plan

    problem = build_problem(
        traced.profile, 2, schedule=schedule, microbatches=micro, cost=plan.cost
    )
    assignment = tuple(plan.stage_of(u.name) for u in traced.profile.units)
    line = simulate_plan(problem, assignment, RUNTIME_COSTS["cpu"], schedule)
    over = pred.step_overhead_ms
    predicted = {
        "actions (busy)": line.busy_ms(),
        "tied all-reduce": over.tied_all_reduce_ms,
        "loss broadcast": over.loss_broadcast_ms,
        "optimizer step": over.optimizer_ms,
        "before first action": over.fixed_ms,
        "step": pred.step_ms[schedule],
    }
    return {
        "model": model,
        "schedule": schedule,
        "measured": [got[0], got[1]],
        "predicted": predicted,
        "load_average_1min": os.getloadavg()[0],
    }


def _markdown(rows: list[dict[str, Any]], steps: int) -> str:
    lines = [
        "# Where a step goes: measured per rank vs predicted",
        "",
        f"2 ranks, gloo, one thread each, SGD, median of {steps} steps; unit times measured before the run. "
        "'busy' is the actions' compute after their receives arrived; predicted busy is the simulated "
        "actions' time per rank (runtime costs included); the fixed Python per step is set against the "
        "time before the first action (rank 1's also waits for its first input). The tied all-reduce "
        "and the loss broadcast are collectives: the rank that comes first waits there for the other, "
        "so the later rank's figure is the collective's own time.",
        "",
        "| model | schedule | part | rank 0 ms | rank 1 ms | predicted ms | measured / predicted |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for seg in SEGMENTS:
            m0, m1 = r["measured"][0][seg], r["measured"][1][seg]
            p = r["predicted"].get(seg)
            if isinstance(p, list):
                ratio = max(m0 / p[0] if p[0] else 0.0, m1 / p[1] if p[1] else 0.0)
                ptext = ", ".join(f"{x:.2f}" for x in p)
            else:  # a collective: the later rank's time is its own, the earlier one's includes the wait
                ratio = (
                    (min(m0, m1) if seg in COLLECTIVES else max(m0, m1)) / p if p else float("nan")
                )
                ptext = f"{p:.2f}" if p is not None else ""
            lines.append(
                f"| {r['model']} | {r['schedule']} | {seg} | {m0:.2f} | {m1:.2f} | {ptext} | "
                f"{ratio:.2f} |"
                if p is not None
                else f"| {r['model']} | {r['schedule']} | {seg} | {m0:.2f} | {m1:.2f} | | |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--models", default="gpt,gpt_medium", help=f"comma-separated, of {sorted(MODELS)}"
    )
    p.add_argument("--schedules", default="gpipe,1f1b,zb-h1")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.path.insert(0, str(ROOT))
    rows = [
        _measure(m, s, args.steps)
        for m in args.models.split(",")
        for s in args.schedules.split(",")
    ]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "step_segments.json").write_text(
        json.dumps({"rows": rows, "steps": args.steps}, indent=1) + "\n"
    )
    (args.out / "step_segments.md").write_text(_markdown(rows, args.steps))
    print(_markdown(rows, args.steps))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
