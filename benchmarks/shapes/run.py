"""Dynamic shapes (#36): bucketed lengths on one dynamic build vs padding to the data set's
longest on a static build (real tokens per second), and one dynamic trace + plan vs one per length.

Design: README.md next to this file. Run (once, ~5-10 min on a loaded 2-core host):
``PYTHONPATH=. .venv/bin/python benchmarks/shapes/run.py``; writes ``results.json`` and
``results.md`` next to this file.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT / "tests" / "runtime"))
sys.path.insert(0, str(HERE))

import varlen_llama as data
from spawn import spawn

from fxpipe.codegen import write_build_dir
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file

MODEL = HERE / "varlen_llama.py"
MICROBATCHES, SCHEDULE, LR = 2, "1f1b", 1e-3
STEPS = len(data.batches()) + 1  # step 1 is warm-up; steps 2..25 see every batch exactly once
DYNAMIC_TRACE_LEN = 32
STATIC_LENGTHS = (16, 32, 64, 128)
TRAIN_ORDER = ("dynamic", "static", "static", "dynamic")  # ABBA: two runs each, alternating
TRACE_ROUNDS = (("dynamic", "per-length"), ("per-length", "dynamic"))


def _env(dynamic: bool, trace_len: int, pad: str = "bucket") -> None:
    os.environ["FXPIPE_SHAPES_DYNAMIC"] = "1" if dynamic else "0"
    os.environ["FXPIPE_SHAPES_TRACE_LEN"] = str(trace_len)
    os.environ["FXPIPE_SHAPES_PAD"] = pad


def _trace_plan(dynamic: bool, trace_len: int) -> tuple[Any, Any, float, float]:
    _env(dynamic, trace_len)
    source = load_model_file(MODEL)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        start = time.perf_counter()
        traced = trace_model_file(source, data.BATCH // MICROBATCHES, progress=False)
        traced_s = time.perf_counter() - start
        start = time.perf_counter()
        plan = plan_partition(traced.profile, 2, microbatches=MICROBATCHES, schedule=SCHEDULE)
        plan_s = time.perf_counter() - start
    return traced, plan, traced_s, plan_s


def trace_part() -> list[dict[str, Any]]:
    rounds = []
    for order in TRACE_ROUNDS:
        row: dict[str, Any] = {"order": list(order)}
        for what in order:
            if what == "dynamic":
                _, _, t, p = _trace_plan(True, DYNAMIC_TRACE_LEN)
                row["dynamic"] = {"trace_s": round(t, 3), "plan_s": round(p, 3)}
            else:
                per = {}
                for n in STATIC_LENGTHS:
                    _, _, t, p = _trace_plan(False, n)
                    per[n] = {"trace_s": round(t, 3), "plan_s": round(p, 3)}
                row["per_length"] = per
        rounds.append(row)
        print("trace round", row, flush=True)
    return rounds


def _build(out: Path, dynamic: bool, trace_len: int) -> Path:
    traced, plan, _, _ = _trace_plan(dynamic, trace_len)
    source = load_model_file(MODEL)
    write_build_dir(traced, plan, out, source, batch_size=data.BATCH, microbatches=MICROBATCHES)
    return out


def _train_job(rank: int, world: int, build: str) -> Any:
    import fxpipe.runtime.train.loop as training
    from fxpipe.runtime.train.run_options import RunOptions

    options = RunOptions(steps=STEPS, lr=LR, timeout_s=300, schedule=SCHEDULE)
    return training.train(Path(build), options, Path(build) / f"run_{rank}.json")


def _tokens() -> tuple[list[int], dict[str, list[int]]]:
    """Real tokens and processed (padded) tokens of each step 1..STEPS, per mode."""
    lens, order = data.lengths(), data.batches()
    steps = [order[s % len(order)] for s in range(STEPS)]
    real = [sum(lens[i] for i in b) for b in steps]
    padded = {
        "dynamic": [len(b) * max(lens[i] for i in b) for b in steps],
        "static": [len(b) * data.MAX_LEN for b in steps],
    }
    return real, padded


def train_part(tmp: Path) -> dict[str, Any]:
    builds = {
        "dynamic": _build(tmp / "dynamic", True, DYNAMIC_TRACE_LEN),
        "static": _build(tmp / "static", False, data.MAX_LEN),
    }
    real, padded = _tokens()
    runs = []
    for i, mode in enumerate(TRAIN_ORDER):
        _env(mode == "dynamic", 0, "bucket" if mode == "dynamic" else "longest")
        record = spawn(_train_job, 2, str(builds[mode]), timeout=600)[0].value
        timed = list(record.step_seconds[1:])  # drop the warm-up step
        seconds = sum(timed)
        run = {
            "run": i + 1,
            "mode": mode,
            "timed_steps": len(timed),
            "seconds": round(seconds, 3),
            "median_step_ms": round(1000 * statistics.median(timed), 1),
            "real_tokens": sum(real[1:]),
            "processed_tokens": sum(padded[mode][1:]),
            "real_tokens_per_s": round(sum(real[1:]) / seconds, 1),
            "losses": [round(v, 6) if v is not None else None for v in record.losses],
        }
        runs.append(run)
        print("train run", {k: v for k, v in run.items() if k != "losses"}, flush=True)
    return {"runs": runs}


def main() -> None:
    torch.set_num_threads(1)
    started = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        train = train_part(Path(tmp))
    trace = trace_part()
    by = {
        m: [r["real_tokens_per_s"] for r in train["runs"] if r["mode"] == m]
        for m in ("dynamic", "static")
    }
    loss = {
        m: next(r["losses"] for r in train["runs"] if r["mode"] == m) for m in ("dynamic", "static")
    }
    loss_diff = max(abs(a - b) / abs(b) for a, b in zip(loss["dynamic"], loss["static"]))
    dyn = [r["dynamic"]["trace_s"] + r["dynamic"]["plan_s"] for r in trace]
    per = [sum(v["trace_s"] + v["plan_s"] for v in r["per_length"].values()) for r in trace]
    summary = {
        "real_tokens_per_s": {m: v for m, v in by.items()},
        "ratio_dynamic_over_static_mean": round(
            statistics.mean(by["dynamic"]) / statistics.mean(by["static"]), 2
        ),
        "ratio_worst_case": round(min(by["dynamic"]) / max(by["static"]), 2),
        "max_rel_loss_diff_dynamic_vs_static": loss_diff,
        "trace_plan_s_dynamic": [round(v, 2) for v in dyn],
        "trace_plan_s_per_length_total": [round(v, 2) for v in per],
        "trace_plan_ratio_per_length_over_dynamic_mean": round(
            statistics.mean(per) / statistics.mean(dyn), 2
        ),
    }
    result = {
        "host": f"{platform.node()} {platform.machine()} {os.cpu_count()} cores "
        "(shared by 6 engineers, heavily loaded)",
        "torch": torch.__version__,
        "config": {
            "model": "transformers Llama, 4 layers, hidden 64, vocab 256, tied",
            "samples": data.SAMPLES,
            "batch": data.BATCH,
            "microbatches": MICROBATCHES,
            "schedule": SCHEDULE,
            "ranks": 2,
            "backend": "gloo",
            "steps": STEPS,
            "max_len": data.MAX_LEN,
            "dynamic_trace_len": DYNAMIC_TRACE_LEN,
            "static_lengths": STATIC_LENGTHS,
            "lengths_mean": statistics.mean(data.lengths()),
            "lengths_median": statistics.median(data.lengths()),
        },
        "summary": summary,
        "train": train,
        "trace": trace,
        "wall_s": round(time.time() - started, 1),
    }
    (HERE / "results.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
