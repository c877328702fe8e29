"""The host-speed gauge against the speed probe: ``CPU_CALL_MS`` and how well the gauge follows the host.

A measured trace prices the runtime's fixed costs at the host's speed, gauged by the cost of
calling a unit that does nearly nothing (``call_overhead_ms``, Note [host speed] in
fxpipe/tracer/measure/calibration.py). This script takes pairs of readings, the gauge as a trace
samples it (``gauge_call_ms``: forward + backward) and right after it
configurations.py's speed probe (the tiny GPT's forward + backward, one thread), and reports:

* ``CPU_CALL_MS``: the median gauge over the pairs whose probe read within 5% of its fastest,
  the quiet speed at which the "cpu" figures were calibrated;
* how the gauge follows the probe: their correlation over all pairs, and the gauge's
  slowdown against the probe's in bands of the probe's.

    PYTHONPATH=.:benchmarks/prediction .venv/bin/python benchmarks/prediction/host_speed.py --out DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

from configurations import _probe_ms

from fxpipe.tracer.measure.calibration import CPU_CALL_MS
from fxpipe.tracer.measure.timing import call_overhead_ms, gauge_call_ms

QUIET_BAND = 1.05  # a pair is quiet where its probe is within this of the fastest


def _pairs(count: int) -> list[tuple[float, float]]:
    call_overhead_ms("cpu")  # warm the call's path, as a trace does
    pairs = []
    for _ in range(count):
        fwd, bwd = gauge_call_ms("cpu")
        pairs.append((fwd + bwd, _probe_ms()))
    return pairs


def summarize(pairs: list[tuple[float, float]]) -> dict[str, Any]:
    calls, probes = [c for c, _ in pairs], [p for _, p in pairs]
    fastest = min(probes)
    quiet = [c for c, p in pairs if p <= QUIET_BAND * fastest]
    reference = statistics.median(quiet)
    bands = []
    for low, high in ((1.0, 1.05), (1.05, 1.2), (1.2, 1.5), (1.5, 10.0)):
        inside = [(c, p) for c, p in pairs if low * fastest <= p < high * fastest]
        if inside:
            bands.append(
                {
                    "probe_slowdown": [low, high],
                    "pairs": len(inside),
                    "probe_median": statistics.median(p / fastest for _, p in inside),
                    "gauge_median": statistics.median(c / reference for c, _ in inside),
                }
            )
    return {
        "pairs": [list(p) for p in pairs],
        "probe_fastest_ms": fastest,
        "quiet_pairs": len(quiet),
        "call_ms_quiet": reference,
        "CPU_CALL_MS_in_use": CPU_CALL_MS,
        "correlation": statistics.correlation(calls, probes),
        "bands": bands,
    }


def _markdown(result: dict[str, Any]) -> str:
    lines = [
        "# Host-speed gauge against the speed probe",
        "",
        f"{len(result['pairs'])} pairs (gauge: `gauge_call_ms` forward + backward; probe: "
        "configurations.py's `_probe_ms`). "
        f"Fastest probe {result['probe_fastest_ms']:.2f} ms; gauge at the quiet speed (probe within 5% of "
        f"its fastest, {result['quiet_pairs']} pairs): **{result['call_ms_quiet'] * 1e3:.1f} us** "
        f"(`CPU_CALL_MS` in use: {result['CPU_CALL_MS_in_use'] * 1e3:.1f} us). "
        f"Correlation of gauge and probe over all pairs: {result['correlation']:.2f}.",
        "",
        "| probe / its fastest | pairs | probe slowdown (median) | gauge slowdown (median) |",
        "|---|---|---|---|",
    ]
    for b in result["bands"]:
        low, high = b["probe_slowdown"]
        lines.append(
            f"| {low:.2f}-{high:.2f} | {b['pairs']} | {b['probe_median']:.2f} | {b['gauge_median']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=300)
    p.add_argument("--out", type=Path, default=Path(__file__).parent)
    args = p.parse_args(argv)
    start = time.perf_counter()
    result = summarize(_pairs(args.pairs))
    result["seconds"] = time.perf_counter() - start
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "host_speed.json").write_text(json.dumps(result, indent=1))
    (args.out / "host_speed.md").write_text(_markdown(result))
    print(_markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
