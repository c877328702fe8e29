"""Trace time and unit count of the examples and a GPT-2-small-sized model, analytic and measured.

Usage: ``.venv/bin/python benchmarks/trace/run.py [--skip-measured-gpt2]``; writes
``results.json`` and ``results.md`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "examples"))

from fxpipe.modelfile import load_model_file  # noqa: E402
from fxpipe.tracer import trace_model  # noqa: E402

EXAMPLES = ("mlp", "gpt", "resnet", "branchy")
TARGET_GPT2_ANALYTIC_S = 30.0


def _cases() -> list[tuple[str, Callable[[], torch.nn.Module], tuple[torch.Tensor, ...], int]]:
    import hf_models

    cases = []
    for name in EXAMPLES:
        source = load_model_file(ROOT / "examples" / f"{name}.py")
        cases.append((name, source.build_model, source.example_inputs(4), 4))
    cases.append(("hf-gpt2-tiny", hf_models.build_gpt2, hf_models.example_inputs(4), 4))
    cases.append(("hf-bert-tiny", hf_models.build_bert, hf_models.bert_inputs(4), 4))
    cases.append(
        (
            "gpt2-small (12x768, seq 128)",
            hf_models.build_gpt2_small,
            hf_models.gpt2_small_inputs(1),
            1,
        )
    )
    return cases


def _run(
    build: Callable[[], torch.nn.Module], inputs: tuple[torch.Tensor, ...], measured: bool
) -> dict[str, Any]:
    torch.manual_seed(0)
    model = build()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        traced = trace_model(model, inputs, measure_times=measured, progress=False)
        seconds = time.perf_counter() - start
    p = traced.profile
    return {
        "mode": "measured" if measured else "analytic",
        "frontend": traced.frontend,
        "seconds": round(seconds, 3),
        "units": len(p.units),
        "edges": len(p.edges),
        "fwd_ms_total": round(sum(u.fwd_ms for u in p.units), 3),
        "bwd_ms_total": round(sum(u.bwd_ms for u in p.units), 3),
        "param_mib": round(p.total_param_bytes / 2**20, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--skip-measured-gpt2", action="store_true", help="skip the slow measured GPT-2 small run"
    )
    args = parser.parse_args()
    rows = []
    for name, build, inputs, batch in _cases():
        for measured in (False, True):
            if measured and args.skip_measured_gpt2 and name.startswith("gpt2-small"):
                continue
            row = {"model": name, "batch": batch, **_run(build, inputs, measured)}
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "target_gpt2_small_analytic_s": TARGET_GPT2_ANALYTIC_S,
    }
    (HERE / "results.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    lines = [
        "# Trace benchmark results",
        "",
        f"torch {meta['torch']}, Python {meta['python']}, {meta['threads']} threads (CPU). "
        f"Target: GPT-2 small analytic trace under {TARGET_GPT2_ANALYTIC_S:.0f} s.",
        "",
        "| model | batch | mode | front end | seconds | units | edges | fwd ms | bwd ms | params MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['model']} | {r['batch']} | {r['mode']} | {r['frontend']} | {r['seconds']} | {r['units']} | "
        f"{r['edges']} | {r['fwd_ms_total']} | {r['bwd_ms_total']} | {r['param_mib']} |"
        for r in rows
    ]
    (HERE / "results.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
