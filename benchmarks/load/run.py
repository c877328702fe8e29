"""Peak memory and time of ``load_stage`` per stage vs building the whole model.

Builds a large MLP (default 16 x Linear(2048, 2048), 268 MB of fp32 weights) into a
4-stage build directory with the uniform solver, then measures in a fresh process per
case the peak RSS growth (VmHWM - VmRSS before) and the wall time of
``build_model()`` and of ``load_stage(dir, i)`` for each stage, each followed by
reading every tensor once (safetensors maps the file lazily, so an untouched stage
would look almost free). Writes
``results.json`` and ``results.md`` next to this script.

    .venv/bin/python benchmarks/load/run.py [--width 2048] [--layers 16] [--stages 4] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent

MODEL = """
import torch
import torch.nn as nn

WIDTH, LAYERS = {width}, {layers}


def build_model():
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)))


def example_inputs(batch_size):
    return (torch.randn(batch_size, WIDTH),)
"""

MEASURE = """
import sys, time
import torch
from fxpipe.codegen import load_stage
from fxpipe.modelfile import load_model_file

def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

before = status_kib("VmRSS")
start = time.perf_counter()
if sys.argv[1] == "model":
    obj = load_model_file(sys.argv[2]).build_model()
else:
    obj = load_stage(sys.argv[2], int(sys.argv[3]))
touched = sum(float(t.float().sum()) for t in obj.state_dict().values())  # weights really in memory
seconds = time.perf_counter() - start
print(status_kib("VmHWM") - before, seconds)
"""


def measure(*args: str) -> tuple[float, float]:
    """(peak RSS growth in MiB, seconds) of one fresh process."""
    out = subprocess.run(
        [sys.executable, "-c", MEASURE, *args], capture_output=True, text=True, check=True
    )
    kib, seconds = out.stdout.split()[-2:]
    return int(kib) / 1024, float(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--stages", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()

    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    with tempfile.TemporaryDirectory() as tmp:
        model_file = Path(tmp) / "big_mlp.py"
        model_file.write_text(MODEL.format(width=args.width, layers=args.layers))
        source = load_model_file(model_file)
        traced = trace_model_file(source, 1, progress=False)
        plan = plan_partition(traced.profile, args.stages, solver="uniform")
        build = Path(tmp) / "build"
        manifest = write_build_dir(traced, plan, build, source, batch_size=1, microbatches=1)
        del traced
        weights_mib = sum((build / sm.weights).stat().st_size for sm in manifest.stages) / 2**20

        def median(*cmd: str) -> tuple[float, float]:
            runs = [measure(*cmd) for _ in range(args.repeat)]
            return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)

        whole_mib, whole_s = median("model", str(model_file))
        stages = []
        for sm in manifest.stages:
            mib, seconds = median("stage", str(build), str(sm.index))
            stages.append(
                {
                    "stage": sm.index,
                    "weights_mib": round((build / sm.weights).stat().st_size / 2**20, 1),
                    "peak_rss_mib": round(mib, 1),
                    "seconds": round(seconds, 4),
                    "memory_ratio": round(mib / whole_mib, 3),
                    "time_ratio": round(seconds / whole_s, 3),
                }
            )

    results = {
        "model": f"{args.layers} x Linear({args.width}, {args.width}) + ReLU, fp32",
        "weights_mib": round(weights_mib, 1),
        "stages": args.stages,
        "repeat": args.repeat,
        "whole_model": {"peak_rss_mib": round(whole_mib, 1), "seconds": round(whole_s, 4)},
        "load_stage": stages,
        "machine": f"{platform.machine()}, {platform.python_version()}, torch {__import__('torch').__version__}",
    }
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    lines = [
        f"# load_stage vs building the whole model: {results['model']} ({results['weights_mib']} MiB)",
        "",
        f"Median of {args.repeat} fresh processes each; peak RSS growth = VmHWM - VmRSS before the call.",
        "",
        f"Whole model `build_model()`: {whole_mib:.1f} MiB, {whole_s * 1000:.0f} ms",
        "",
        "| stage | weights MiB | peak RSS MiB | time ms | memory ratio | time ratio |",
        "|---:|---:|---:|---:|---:|---:|",
    ]
    for s in stages:
        lines.append(
            f"| {s['stage']} | {s['weights_mib']} | {s['peak_rss_mib']} | {s['seconds'] * 1000:.0f} | "
            f"{s['memory_ratio']} | {s['time_ratio']} |"
        )
    lines += ["", f"Machine: {results['machine']}"]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
