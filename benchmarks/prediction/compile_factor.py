"""The compiled-kernel factor: a unit's time under ``torch.compile`` over its eager time.

``fxpipe trace --compile`` without ``--measure-times`` scales the analytic unit times by
``device_presets.<device>.compile_factor`` (calibration.json; Note [compiled unit times] in
fxpipe/tracer/measure/timing.py). This script measures it as a trace would: it traces a model file
twice with ``--measure-times``, eager and compiled (each distinct unit compiled once, the
compiled call's own cost taken off), and prints the sums of the units' forward and backward
times and their ratios (compiled / eager). The "total" ratio is the factor.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/compile_factor.py [examples/gpt.py] [--batch 8]

Set ``TORCHINDUCTOR_CACHE_DIR`` to reuse compiled kernels across runs (the first run compiles
every distinct unit: about a minute for examples/gpt.py on the 2-core VM).
"""

from __future__ import annotations

import argparse
import time

from fxpipe.modelfile import load_model_file
from fxpipe.tracer.api import trace_model_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="examples/gpt.py")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    source = load_model_file(args.model)
    sums = {}
    for compiled in (False, True):
        start = time.perf_counter()
        profile = trace_model_file(
            source,
            args.batch,
            measure_times=True,
            compile=compiled,
            trace_device=args.device,
            progress=False,
        ).profile
        fwd = sum(u.fwd_ms for u in profile.units)
        bwd = sum(u.bwd_ms for u in profile.units)
        sums[compiled] = (fwd, bwd)
        print(
            f"{'compiled' if compiled else 'eager':8} {len(profile.units)} units: forward "
            f"{fwd:.3f} ms, backward {bwd:.3f} ms (traced in {time.perf_counter() - start:.0f} s)",
            flush=True,
        )
    (ef, eb), (cf, cb) = sums[False], sums[True]
    print(
        f"compiled / eager: forward {cf / ef:.3f}, backward {cb / eb:.3f}, "
        f"total {(cf + cb) / (ef + eb):.3f}"
    )


if __name__ == "__main__":
    main()
