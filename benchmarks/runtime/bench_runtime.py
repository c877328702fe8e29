"""Runtime benchmark: fxpipe vs torch.distributed.pipelining on the same generated stages.

    .venv/bin/python benchmarks/runtime/bench_runtime.py [--steps 20] [--out benchmarks/runtime]

For each model it builds a 2-stage build directory (unit times measured with one
thread, as each torchrun worker runs), then under torchrun (2 ranks, gloo, CPU) times
fxpipe's ``PipelineRunner`` and ``torch.distributed.pipelining`` (``PipelineStage``
wrapping the SAME ``load_stage`` modules, ``ScheduleGPipe`` / ``Schedule1F1B``)
alternately step by step, each step between two barriers. It then runs
``fxpipe.runtime.launch.launcher.run_build`` for the measured step time vs the plan's
prediction and the peak memory per rank, and one process training the original model
for its peak memory. Writes results.json and results.md.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MODELS = {  # name: (model file, batch size, microbatches)
    "gpt (examples/gpt.py)": (ROOT / "examples" / "gpt.py", 16, 4),
    "gpt_medium": (ROOT / "benchmarks" / "runtime" / "gpt_medium.py", 16, 4),
}
SCHEDULES = ("gpipe", "1f1b")
LR = 0.01


def _rss_peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _build(model_file: Path, out: Path, batch: int, microbatches: int) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    torch.set_num_threads(1)
    source = load_model_file(model_file)
    traced = trace_model_file(source, batch // microbatches, measure_times=True)
    plan = plan_partition(traced.profile, 2, microbatches=microbatches)
    write_build_dir(traced, plan, out, source, batch_size=batch, microbatches=microbatches)


def _worker(build_dir: Path, steps: int, microbatches: int, batch: int) -> None:
    """Run under torchrun: fxpipe and pipelining side by side, alternating steps."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    from fxpipe.codegen import load_stage
    from fxpipe.codegen.manifest import Manifest
    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    manifest = Manifest.from_json(build_dir)
    source = load_model_file(manifest.model_path(build_dir), model_fn=manifest.model_fn)
    inputs, targets = source.example_inputs(batch), source.example_targets(batch)
    last = rank == world - 1

    class Unwrap(torch.nn.Module):  # pipelining hands the last stage's raw output to loss_fn
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, *args: torch.Tensor) -> torch.Tensor:
            out = self.inner(*args)
            return out[0] if isinstance(out, tuple) and len(out) == 1 else out

    out = {}
    for name in SCHEDULES:
        fx = PipelineRunner(
            build_dir,
            source.loss_fn,
            schedule=name,
            microbatches=microbatches,
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        )
        module = load_stage(build_dir, rank)
        stage = PipelineStage(Unwrap(module) if last else module, rank, world, torch.device("cpu"))
        cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
        sched = cls(stage, n_microbatches=microbatches, loss_fn=source.loss_fn)
        opt = torch.optim.SGD(module.parameters(), lr=LR)

        # Tied parameters (GPT's wte/lm_head) live on both ranks: training them correctly needs their
        # gradients summed, which fxpipe does for you; pipelining needs it written by hand, as here.
        tied = [
            module.get_parameter(tie.keys[tie.stages.index(rank)])
            for tie in manifest.ties
            if rank in tie.stages
        ]

        def pp_step() -> float:
            opt.zero_grad()
            losses: list[torch.Tensor] = []
            if rank == 0:
                sched.step(*inputs)
            else:
                sched.step(target=targets, losses=losses)
            for p in tied:
                dist.all_reduce(p.grad)
            opt.step()
            return float(torch.stack(losses).mean()) if losses else float("nan")

        times = {"fxpipe": [], "pipelining": []}
        first = {
            "fxpipe": fx.step(inputs, targets),
            "pipelining": pp_step(),
        }  # warm-up; step-1 loss
        for _ in range(2):
            fx.step(inputs, targets)
            pp_step()
        for _ in range(steps):
            for label, fn in (
                ("fxpipe", lambda: fx.step(inputs, targets)),
                ("pipelining", pp_step),
            ):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[label].append(time.perf_counter() - t0)
        out[name] = {"times": times, "first_loss": first}
    if rank == world - 1:
        (build_dir / "sidebyside.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _single(build_dir: Path, steps: int, microbatches: int, batch: int) -> None:
    """One process training the original model (same weights, microbatches): step time and peak RSS."""
    sys.path.insert(0, str(ROOT / "tests" / "runtime"))
    from fxpipe.codegen.manifest import Manifest
    from fxpipe.modelfile import load_model_file

    torch.set_num_threads(1)
    base = _rss_peak()
    manifest = Manifest.from_json(build_dir)
    source = load_model_file(manifest.model_path(build_dir), model_fn=manifest.model_fn)
    model = source.build_model().train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, targets = source.example_inputs(batch), source.example_targets(batch)
    chunks = list(zip(*(x.chunk(microbatches) for x in inputs)))
    tchunks = targets.chunk(microbatches)
    times = []
    for _ in range(steps + 3):
        t0 = time.perf_counter()
        opt.zero_grad()
        for mb, t in zip(chunks, tchunks):
            (source.loss_fn(model(*mb), t) / microbatches).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    print(
        json.dumps(
            {
                "step_ms": statistics.median(times[3:]) * 1e3,
                "peak_rss": _rss_peak(),
                "base_rss": base,
            }
        )
    )


def _bench(
    name: str, model_file: Path, batch: int, microbatches: int, steps: int, tmp: Path
) -> dict:
    from launch_ranks import torchrun

    from fxpipe.runtime.launch.launcher import run_build
    from fxpipe.runtime.train.run_options import RunOptions

    build_dir = tmp / name.split()[0]
    py = sys.executable
    subprocess.run(
        [py, __file__, "--build", str(model_file), str(build_dir), str(batch), str(microbatches)],
        check=True,
    )
    subprocess.run(
        torchrun(__file__, 2, str(build_dir), str(steps), str(microbatches), str(batch), python=py),
        check=True,
        stderr=subprocess.DEVNULL,
    )
    side = json.loads((build_dir / "sidebyside.json").read_text())
    single = json.loads(
        subprocess.run(
            [py, __file__, "--single", str(build_dir), str(steps), str(microbatches), str(batch)],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    plan = json.loads((build_dir / "plan.json").read_text())
    result = {
        "model": name,
        "batch_size": batch,
        "microbatches": microbatches,
        "ranks": 2,
        "backend": "gloo",
        "stage_units": [len(s["units"]) for s in plan["stages"]],
        "schedules": {},
        "one_process": {
            "step_ms": single["step_ms"],
            "peak_rss_bytes": single["peak_rss"],
            "rss_after_import_bytes": single["base_rss"],
        },
    }
    for sched in SCHEDULES:
        options = RunOptions(steps=steps, schedule=sched, microbatches=microbatches, lr=LR)
        run = run_build(build_dir, options, quiet=True)
        fx = statistics.median(side[sched]["times"]["fxpipe"]) * 1e3
        pp = statistics.median(side[sched]["times"]["pipelining"]) * 1e3
        pred = run.predicted_step_ms
        result["schedules"][sched] = {
            "fxpipe_step_ms": fx,
            "pipelining_step_ms": pp,
            "fxpipe_over_pipelining": fx / pp,
            "first_loss": side[sched]["first_loss"],
            "run_build_median_step_ms": run.median_step_ms,
            "predicted_step_ms": pred,
            "measured_over_predicted": run.median_step_ms / pred if pred else None,
            "peak_rss_bytes_per_rank": list(run.peak_memory_bytes),
        }
    return result


def _markdown(results: list[dict]) -> str:
    mib = 1 << 20
    lines = [
        "# Runtime benchmark results",
        "",
        "2 ranks, gloo on 127.0.0.1, CPU, one thread per rank, SGD; medians over the timed steps. "
        "See README.md for the method.",
        "",
        "| model | schedule | fxpipe ms | pipelining ms | fxpipe / pipelining | run_build ms | "
        "plan predicted ms | measured / predicted |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for s, v in r["schedules"].items():
            pred = f"{v['predicted_step_ms']:.2f}" if v["predicted_step_ms"] else "n/a"
            ratio = f"{v['measured_over_predicted']:.2f}" if v["measured_over_predicted"] else "n/a"
            lines.append(
                f"| {r['model']} | {s} | {v['fxpipe_step_ms']:.2f} | {v['pipelining_step_ms']:.2f} | "
                f"{v['fxpipe_over_pipelining']:.2f} | {v['run_build_median_step_ms']:.2f} | {pred} | {ratio} |"
            )
    lines += [
        "",
        "Peak resident memory (MiB; the torch runtime alone is the 'after import' figure):",
        "",
        "| model | one process (after import) | one process peak | rank 0 peak (gpipe, 1f1b) | "
        "rank 1 peak (gpipe, 1f1b) |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        one = r["one_process"]
        g, f = (
            r["schedules"]["gpipe"]["peak_rss_bytes_per_rank"],
            r["schedules"]["1f1b"]["peak_rss_bytes_per_rank"],
        )
        lines.append(
            f"| {r['model']} | {one['rss_after_import_bytes'] / mib:.0f} | {one['peak_rss_bytes'] / mib:.0f} | "
            f"{g[0] / mib:.0f}, {f[0] / mib:.0f} | {g[1] / mib:.0f}, {f[1] / mib:.0f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--build", "--worker", "--single"):
        mode, rest = sys.argv[1], sys.argv[2:]
        if mode == "--build":
            _build(Path(rest[0]), Path(rest[1]), int(rest[2]), int(rest[3]))
        elif mode == "--worker":
            _worker(Path(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]))
        else:
            _single(Path(rest[0]), int(rest[1]), int(rest[2]), int(rest[3]))
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    with tempfile.TemporaryDirectory() as tmp:
        results = [
            _bench(name, f, b, m, args.steps, Path(tmp)) for name, (f, b, m) in MODELS.items()
        ]
    meta = {
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "steps": args.steps,
        "note": "shared 2-core machine; other jobs may have been running",
    }
    (args.out / "results.json").write_text(
        json.dumps({"meta": meta, "results": results}, indent=1) + "\n"
    )
    (args.out / "results.md").write_text(_markdown(results))
    print(_markdown(results))


if __name__ == "__main__":
    main()
