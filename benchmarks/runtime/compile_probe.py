"""One emitted stage, eager against ``torch.compile``: forward, and forward + backward, fp32 and bf16.

    python benchmarks/runtime/compile_probe.py [--device cuda] [--model gpt_wide] [--iters 20] [--out DIR]

The groundwork for compiled stages (issue 39): how much ``torch.compile`` gives one stage that
fxpipe emitted, before any pipeline runs it. Fixed design, chosen before the first run: the model's
2-stage build (analytic CPU trace, the default plan), stage 0 loaded alone with ``load_stage`` on
the device, one microbatch of the model's batch / microbatches. Variants: eager and
``torch.compile(stage)`` (default mode, dynamic=False), each in fp32 and under bf16 autocast. Each
variant: the first call timed alone (for compiled variants: the compile), 3 warm-up calls, then
``--iters`` timed calls; the median is reported. Forward-only calls run under ``torch.no_grad``;
forward + backward calls back-propagate the sum of the outputs. Writes
compile_probe_<model>_<device>.json / .md.
``--gemm-share``: also profile 10 fp32 forward + backward calls of each variant (torch.profiler)
and split their time into matrix products (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``: kernels
torch.compile leaves to the same library calls) and everything else, the part compiling can shrink.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[2]
MODELS = {  # name: (model file, batch size, microbatches)
    "gpt": (ROOT / "examples" / "gpt.py", 8, 4),
    "gpt_medium": (ROOT / "benchmarks" / "runtime" / "gpt_medium.py", 16, 4),
    "gpt_wide": (ROOT / "benchmarks" / "prediction" / "gpt_wide.py", 16, 4),
    "llama_medium": (ROOT / "benchmarks" / "runtime" / "llama_medium.py", 16, 4),
}


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _timed(fn: Callable[[], Any], device: str, iters: int) -> tuple[float, float]:
    """(first call ms, median of ``iters`` calls after 3 warm-ups, ms)."""
    _sync(device)
    t0 = time.perf_counter()
    fn()
    _sync(device)
    first = (time.perf_counter() - t0) * 1e3
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return first, statistics.median(times)


def _stage_and_inputs(name: str, device: str, builds: Path) -> tuple[Any, tuple[Any, ...]]:
    import torch

    from fxpipe.codegen import load_stage, write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    model_file, batch, micro = MODELS[name]
    source = load_model_file(model_file)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_model_file(source, batch // micro, progress=False)
    plan = plan_partition(traced.profile, 2, microbatches=micro)
    build = builds / name
    write_build_dir(traced, plan, build, source, batch_size=batch, microbatches=micro)
    stage = load_stage(build, 0, device=device)
    inputs = tuple(
        x.to(device) if isinstance(x, torch.Tensor) else x
        for x in source.example_inputs(batch // micro)
    )
    return stage, inputs


def _forward_backward(module: Any, stage: Any, inputs: tuple[Any, ...], autocast: Any) -> None:
    """One forward (under ``autocast()``) and a backward of the sum of the outputs; ``stage``'s
    gradients dropped."""
    import torch

    with autocast():
        out = module(*inputs)
    outs = out if isinstance(out, tuple) else (out,)
    sum(o.float().sum() for o in outs if isinstance(o, torch.Tensor) and o.requires_grad).backward()
    stage.zero_grad(set_to_none=True)


def _variants(
    stage: Any, compiled: Any, inputs: tuple[Any, ...], device: str, iters: int
) -> list[dict[str, Any]]:
    import torch

    rows = []
    for precision in ("fp32", "bf16"):
        for label, module in (("eager", stage), ("compiled", compiled)):

            def autocast() -> Any:
                return torch.autocast(device, dtype=torch.bfloat16, enabled=precision == "bf16")

            def forward() -> None:
                with torch.no_grad(), autocast():
                    module(*inputs)

            def forward_backward() -> None:
                _forward_backward(module, stage, inputs, autocast)

            f_first, f_ms = _timed(forward, device, iters)
            fb_first, fb_ms = _timed(forward_backward, device, iters)
            rows.append(
                {
                    "variant": label,
                    "precision": precision,
                    "forward_ms": f_ms,
                    "forward_first_ms": f_first,
                    "forward_backward_ms": fb_ms,
                    "forward_backward_first_ms": fb_first,
                }
            )
    return rows


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _gemm_share(
    stage: Any, compiled: Any, inputs: tuple[Any, ...], device: str, calls: int = 10
) -> list[dict[str, Any]]:
    """Per variant (fp32 forward + backward): ms per call in matrix products and in the rest; on
    CUDA the GPU's time (each product op's kernels against every kernel), not the launches'."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])

    rows = []
    for label, module in (("eager", stage), ("compiled", compiled)):
        for _ in range(3):
            _forward_backward(module, stage, inputs, contextlib.nullcontext)
        with profile(activities=activities) as prof:
            for _ in range(calls):
                _forward_backward(module, stage, inputs, contextlib.nullcontext)
            if cuda:
                torch.cuda.synchronize()
        events = prof.key_averages()
        if cuda:  # an op's device time is its kernels'; self device time counts each kernel once
            total = sum(e.self_device_time_total for e in events) / 1e3 / calls
            gemm = sum(e.device_time_total for e in events if e.key in GEMM_OPS) / 1e3 / calls
        else:
            total = sum(e.self_cpu_time_total for e in events) / 1e3 / calls
            gemm = sum(e.self_cpu_time_total for e in events if e.key in GEMM_OPS) / 1e3 / calls
        rows.append(
            {"variant": label, "total_ms": total, "gemm_ms": gemm, "other_ms": total - gemm}
        )
    return rows


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        f"# One stage, eager vs torch.compile ({result['device_name']}, torch {result['torch']})",
        "",
        f"{result['model']}, stage 0 of 2, one microbatch; median of {result['iters']} calls after 3 warm-ups; "
        "'first' is the first call alone (the compile, for compiled rows).",
        "",
        "| variant | precision | forward ms | fwd+bwd ms | first fwd ms | first fwd+bwd ms | fwd+bwd vs eager |",
        "|---|---|---|---|---|---|---|",
    ]
    eager = {
        r["precision"]: r["forward_backward_ms"] for r in result["rows"] if r["variant"] == "eager"
    }
    for r in result["rows"]:
        lines.append(
            f"| {r['variant']} | {r['precision']} | {r['forward_ms']:.2f} | {r['forward_backward_ms']:.2f} "
            f"| {r['forward_first_ms']:.0f} | {r['forward_backward_first_ms']:.0f} "
            f"| {r['forward_backward_ms'] / eager[r['precision']]:.2f} |"
        )
    if result.get("gemm_share"):
        lines += [
            "",
            "fp32 forward + backward under torch.profiler (10 calls; ms per call, profiler included; "
            "on CUDA the kernels' time):",
            "",
            "| variant | total ms | matrix products ms | rest ms | products / total |",
            "|---|---|---|---|---|",
        ]
        for r in result["gemm_share"]:
            lines.append(
                f"| {r['variant']} | {r['total_ms']:.2f} | {r['gemm_ms']:.2f} | {r['other_ms']:.2f} "
                f"| {r['gemm_ms'] / r['total_ms']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--model", default="gpt_wide", choices=tuple(MODELS))
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    p.add_argument("--gemm-share", action="store_true", help="split fp32 fwd+bwd time by op kind")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    with tempfile.TemporaryDirectory() as tmp:
        stage, inputs = _stage_and_inputs(args.model, args.device, Path(tmp))
        compiled = torch.compile(stage)  # one compile serves both measurements
        rows = _variants(stage, compiled, inputs, args.device, args.iters)
        gemm = _gemm_share(stage, compiled, inputs, args.device) if args.gemm_share else []
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    result = {
        "model": args.model,
        "device": args.device,
        "device_name": name,
        "torch": torch.__version__,
        "iters": args.iters,
        "rows": rows,
        "gemm_share": gemm,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = f"compile_probe_{args.model}_{args.device}"
    (args.out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
