"""What a split backward costs against the fused one, on one process: the step model's split terms.

    PYTHONPATH=. .venv/bin/python benchmarks/prediction/split_cost.py [--microbatch 4] [--repeats 15]

Runs benchmarks/runtime/gpt_medium.py's transformer blocks (one thread, as a torchrun
rank) forward, then backpropagates a random output gradient either fused
(``torch.autograd.backward``) or split as the runtime's zero-bubble schedules do
(``SplitBackward.inputs`` = B, then ``SplitBackward.weights`` = W), and prints the
medians next to the profile's split (``Unit.bwd_weight_ms``) and the prediction's fixed
split costs (``RUNTIME_COSTS["cpu"]``: ``split_ms``, ``split_unit_ms`` per unit,
``weight_call_ms`` per unit with parameters). The step prediction charges B + W about the
fused backward plus those fixed costs (Note [step prediction]); this says how much more a
split really costs. Seconds on an idle machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--microbatch", type=int, default=4)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument(
        "--model",
        choices=("gpt_medium", "gpt"),
        default="gpt_medium",
        help="benchmarks/runtime/gpt_medium.py or the tiny examples/gpt.py",
    )
    args = p.parse_args(argv)
    import torch

    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner.prediction import RUNTIME_COSTS
    from fxpipe.runtime.pipeline.split_backward import SplitBackward
    from fxpipe.tracer import trace_model_file

    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "benchmarks" / "runtime"))
    sys.path.insert(0, str(ROOT / "examples"))
    import gpt
    import gpt_medium

    if args.model == "gpt_medium":
        model, model_file, block, width = (
            gpt_medium.build_model(),
            ROOT / "benchmarks" / "runtime" / "gpt_medium.py",
            gpt_medium.BLOCK,
            gpt_medium.WIDTH,
        )
    else:
        model, model_file, block, width = (
            gpt.build_model(),
            ROOT / "examples" / "gpt.py",
            gpt.BLOCK,
            gpt.WIDTH,
        )
    blocks = torch.nn.Sequential(*model.blocks)
    params = list(blocks.parameters())
    split = SplitBackward(params)

    def once(fused: bool) -> tuple[float, float]:
        x = torch.randn(args.microbatch, block, width, requires_grad=True)
        y = blocks(x)
        g = torch.randn_like(y)
        t0 = time.perf_counter()
        if fused:
            torch.autograd.backward([y], [g], inputs=[x] + params)
            return time.perf_counter() - t0, 0.0
        _, work = split.inputs([y], [g], [x])
        t1 = time.perf_counter()
        split.weights(work)
        return t1 - t0, time.perf_counter() - t1

    for _ in range(3):
        once(True)
        once(False)
    fused, parts = [], []
    for _ in range(args.repeats):  # alternating, so load changes hit both alike
        fused.append(once(True)[0])
        parts.append(once(False))
    full = statistics.median(fused) * 1e3
    b = statistics.median(x[0] for x in parts) * 1e3
    w = statistics.median(x[1] for x in parts) * 1e3
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        profile = trace_model_file(
            load_model_file(model_file), args.microbatch, progress=False
        ).profile
    units = [u for u in profile.units if u.name.startswith("blocks")]
    bwd, weight = sum(u.bwd_ms for u in units), sum(u.bwd_weight_ms for u in units)
    rt = RUNTIME_COSTS["cpu"]
    fixed = (
        rt.split_ms
        + rt.split_unit_ms * len(units)
        + rt.weight_call_ms * sum(bool(u.params) for u in units)
    )
    print(
        f"measured: fused backward {full:.2f} ms; split B {b:.2f} + W {w:.2f} = {b + w:.2f} ms "
        f"({(b + w) / full:.2f}x fused); B share {b / (b + w):.2f}"
    )
    print(
        f"profile ({profile.timing}): backward {bwd:.2f} ms, W share {weight / bwd:.2f}; "
        f"the prediction's fixed split costs {fixed:.2f} ms ({len(units)} units)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
