"""Scale benchmark: trace + plan wall time and peak RSS against model size, meta and real tensors.

Every measurement runs in a fresh subprocess (so peak RSS is that run's own), on the
Llama-shaped model file ``benchmarks/scale/llama.py`` (125M, 1B, 7B, 70B). Rows:

- ``fxpipe meta``: ``trace_model_file(..., trace_device="meta")`` + ``plan_partition(..., 16 stages)``;
- ``fxpipe cpu``: the same with real tensors (only where the model fits: ``--real``, default 125m);
- ``pipelining meta``: ``torch.distributed.pipelining.pipeline()`` on the same model built under
  ``torch.device("meta")``, split at the layer starts into (at most) 16 stages;
- ``partition``: the whole ``fxpipe partition MODEL --device meta --stages 16`` without ``--weights``
  (``--partition``, default 70b): trace, plan and emit (stage sources, manifest, buffers only);
- ``emit``: ``write_build_dir`` with ``--weights`` from a sharded safetensors checkpoint (written
  here tensor by tensor with random values, ``--emit``, default 1b): its wall time, and its peak
  RSS above the RSS before it started (the process's high-water mark is reset just before).

Run from the repository root: ``python benchmarks/scale/run.py`` (``--help`` for the options).
Writes ``results.json`` and ``results.md`` next to this file.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODEL = HERE / "llama.py"
STAGES = 16


def _rss_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def worker_fxpipe(size: str, device: str) -> dict:
    import torch  # noqa: F401

    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    source = load_model_file(f"{MODEL}:build_{size}")
    t0 = time.perf_counter()
    traced = trace_model_file(source, 1, progress=False, trace_device=device)
    t1 = time.perf_counter()
    plan = plan_partition(traced.profile, STAGES, microbatches=STAGES)
    t2 = time.perf_counter()
    return {
        "trace_s": t1 - t0,
        "plan_s": t2 - t1,
        "total_s": t2 - t0,
        "peak_rss": _peak_rss(),
        "units": len(traced.profile.units),
        "param_bytes": traced.profile.total_param_bytes,
        "stages": plan.num_stages,
        "solver": plan.solver,
        "optimal": plan.optimal,
        "bottleneck_ms": plan.bottleneck_ms,
    }


def worker_pipelining(size: str) -> dict:
    import torch
    from torch.distributed.pipelining import SplitPoint, pipeline

    sys.path.insert(0, str(HERE))
    import llama

    shape = llama.SHAPES[size]
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = llama.Llama(shape)
    ids = torch.zeros(1, llama.SEQ, dtype=torch.long, device="meta")
    stages = min(STAGES, shape.layers)
    spec = {
        f"layers.{round(i * shape.layers / stages)}": SplitPoint.BEGINNING for i in range(1, stages)
    }
    pipe = pipeline(model, mb_args=(ids,), split_spec=spec)
    t1 = time.perf_counter()
    return {"total_s": t1 - t0, "peak_rss": _peak_rss(), "stages": pipe.num_stages}


def write_checkpoint(size: str, folder: Path, shards: int = 4) -> int:
    """A sharded safetensors checkpoint of ``size`` with random values, written one tensor at a time."""
    import torch

    from fxpipe.codegen.checkpoint_weights import write_streamed
    from fxpipe.tracer.measure.meta import build_on_meta

    sys.path.insert(0, str(HERE))
    import llama

    model = build_on_meta(lambda: llama.Llama(llama.SHAPES[size]))
    state = [(k, tuple(t.shape), t.dtype) for k, t in model.state_dict().items()]
    folder.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    per = -(-len(state) // shards)
    for i in range(shards):
        part = state[i * per : (i + 1) * per]
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"

        def fetch(shape: tuple[int, ...], dtype: torch.dtype, seed: int):
            return lambda: (
                torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
                * 0.02
            )

        write_streamed(
            folder / name,
            [(k, s, d, fetch(s, d, j)) for j, (k, s, d) in enumerate(part)],
            {"format": "pt"},
        )
        weight_map.update({k: name for k, _, _ in part})
        total += (folder / name).stat().st_size
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return total


def worker_emit(size: str, checkpoint: str, out: str) -> dict:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    source = load_model_file(f"{MODEL}:build_{size}")
    traced = trace_model_file(source, 1, progress=False, trace_device="meta")
    plan = plan_partition(traced.profile, STAGES, microbatches=STAGES)
    before = _rss_bytes("VmRSS")
    Path("/proc/self/clear_refs").write_text(
        "5"
    )  # reset the high-water mark (VmHWM) to the current RSS
    t0 = time.perf_counter()
    manifest = write_build_dir(
        traced, plan, out, source, batch_size=STAGES, microbatches=STAGES, weights=checkpoint
    )
    t1 = time.perf_counter()
    peak = _rss_bytes("VmHWM")
    stage_bytes = [(Path(out) / sm.weights).stat().st_size for sm in manifest.stages]
    return {
        "emit_s": t1 - t0,
        "rss_before": before,
        "peak_rss_during_emit": peak,
        "emit_rss_increase": peak - before,
        "largest_stage_bytes": max(stage_bytes),
        "total_stage_bytes": sum(stage_bytes),
        "process_peak_rss": _peak_rss(),
    }


def worker_partition(size: str, out: str) -> dict:
    """The whole ``fxpipe partition MODEL --device meta --stages 16`` (no --weights), as the CLI runs it."""
    import contextlib
    import io

    from fxpipe.cli import main as cli
    from fxpipe.codegen import Manifest

    t0 = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()):
        code = cli(
            [
                "partition",
                f"{MODEL}:build_{size}",
                "--device",
                "meta",
                "--stages",
                str(STAGES),
                "--out",
                out,
            ]
        )
    t1 = time.perf_counter()
    if code != 0:
        raise SystemExit(f"fxpipe partition exited with {code}")
    manifest = Manifest.from_json(out)
    stage_bytes = [(Path(out) / sm.weights).stat().st_size for sm in manifest.stages]
    return {
        "partition_s": t1 - t0,
        "peak_rss": _peak_rss(),
        "stages": manifest.num_stages,
        "weights": manifest.weights,
        "build_bytes": sum(f.stat().st_size for f in Path(out).iterdir()),
        "stage_weight_bytes": sum(stage_bytes),
    }


def _run_worker(*args: str, timeout: float = 1800) -> dict:
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    cmd = [sys.executable, str(Path(__file__)), "--worker", *args]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        return {
            "error": (done.stderr.strip().splitlines() or ["?"])[-1],
            "process_wall_s": wall,
            "load_avg": load,
        }
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result.update(process_wall_s=wall, load_avg=load)
    return result


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def _load(row: dict) -> str:
    return f"{row['load_avg']:.1f}" if "load_avg" in row else "n/r"


def _markdown(
    rows: list[dict], emit: list[dict], meta: dict, partition: list[dict] | None = None
) -> str:
    lines = [
        "# Scale benchmark results",
        "",
        f"Machine: {meta['machine']}, {meta['cpus']} CPUs, torch {meta['torch']}; {meta['date']}. "
        f"Trace at microbatch 1, sequence {meta['seq']}, planned into {STAGES} stages "
        f"(pipelining: split at layer starts, at most {STAGES} stages). Peak RSS is the whole "
        "subprocess's (Python + torch imports included); `wall` is the subprocess's wall time, imports included; "
        "`load` is the machine's 1-minute load average when the row started (2 cores: above 2, other jobs were "
        "running and the seconds are inflated; n/r: not recorded).",
        "",
        "| model | params | tool | tensors | units | trace s | plan s | trace+plan s | wall s | peak RSS GB | load | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "error" in r:
            lines.append(
                f"| {r['size']} | {r['params_b']:.2f}B | {r['tool']} | {r['tensors']} | | | | | "
                f"{r.get('process_wall_s', 0):.1f} | | {_load(r)} | failed: {r['error'][:120]} |"
            )
            continue
        trace = f"{r['trace_s']:.1f}" if "trace_s" in r else ""
        plan = f"{r['plan_s']:.1f}" if "plan_s" in r else ""
        note = f"{r['stages']} stages" + (
            f", {r['solver']}{' (optimal)' if r.get('optimal') else ''}" if "solver" in r else ""
        )
        lines.append(
            f"| {r['size']} | {r['params_b']:.2f}B | {r['tool']} | {r['tensors']} | {r.get('units', '')} | "
            f"{trace} | {plan} | {r['total_s']:.1f} | {r['process_wall_s']:.1f} | {_gb(r['peak_rss'])} | "
            f"{_load(r)} | {note} |"
        )
    if partition:  # None or []: no such rows
        lines += [
            "",
            "## The whole `fxpipe partition --device meta` (no --weights)",
            "",
            f"`fxpipe partition llama.py:build_SIZE --device meta --stages {STAGES} --out DIR` run in-process "
            "(trace, count, solve, emit the stage sources, the manifest and the buffers; no parameter is "
            "written: each stage initialises itself at load). `partition s`: the CLI call; `wall s`: the "
            "subprocess, imports included; peak RSS: the subprocess's.",
            "",
            "| model | params | partition s | wall s | peak RSS GB | stages | build MB | stage weights MB (buffers) "
            "| load |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in partition:
            if "error" in r:
                lines.append(
                    f"| {r['size']} | {r['params_b']:.2f}B | | {r.get('process_wall_s', 0):.1f} | | | | | "
                    f"{_load(r)} | failed: {r['error'][:120]} |"
                )
                continue
            lines.append(
                f"| {r['size']} | {r['params_b']:.2f}B | {r['partition_s']:.1f} | {r['process_wall_s']:.1f} | "
                f"{_gb(r['peak_rss'])} | {r['stages']} | {r['build_bytes'] / 1e6:.1f} | "
                f"{r['stage_weight_bytes'] / 1e6:.1f} | {_load(r)} |"
            )
    if emit:
        lines += [
            "",
            "## Emit from a sharded checkpoint",
            "",
            "`write_build_dir(..., weights=<4 safetensors shards + index>)` after a meta trace and plan; "
            "RSS increase = the high-water mark during emit minus the RSS just before it.",
            "",
            "| model | checkpoint GB | emit s | RSS before GB | RSS increase during emit GB | "
            "largest stage GB | increase / largest stage | process peak RSS GB | load |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for e in emit:
            if "error" in e:
                lines.append(f"| {e['size']} | | | | | | failed: {e['error'][:120]} |")
                continue
            lines.append(
                f"| {e['size']} | {_gb(e['checkpoint_bytes'])} | {e['emit_s']:.1f} | {_gb(e['rss_before'])} | "
                f"{_gb(e['emit_rss_increase'])} | {_gb(e['largest_stage_bytes'])} | "
                f"{e['emit_rss_increase'] / e['largest_stage_bytes']:.2f} | {_gb(e['process_peak_rss'])} | "
                f"{_load(e)} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="125m,1b,7b,70b")
    parser.add_argument(
        "--real", default="125m", help="sizes also traced with real tensors (comma list; '' none)"
    )
    parser.add_argument(
        "--no-pipelining", action="store_true", help="skip torch.distributed.pipelining"
    )
    parser.add_argument("--emit", default="1b", help="sizes to emit from a checkpoint ('' none)")
    parser.add_argument(
        "--partition",
        default="70b",
        help="sizes run through the whole `fxpipe partition --device meta` ('' none)",
    )
    parser.add_argument(
        "--scratch", default="/tmp/fxpipe-scale", help="folder for checkpoints and builds"
    )
    parser.add_argument(
        "--merge",
        action="store_true",
        help="keep the rows of results.json that this run does not measure again",
    )
    parser.add_argument("--worker", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    if args.worker:
        kind, *rest = args.worker
        result = {
            "fxpipe": worker_fxpipe,
            "pipelining": worker_pipelining,
            "emit": worker_emit,
            "partition": worker_partition,
        }[kind](*rest)
        print(json.dumps(result))
        return

    import torch

    sys.path.insert(0, str(HERE))
    import llama

    rows: list[dict] = []
    sizes = [s for s in args.sizes.split(",") if s]
    for size in sizes:
        params_b = llama.parameter_count(size) / 1e9
        jobs = [("fxpipe", "meta", ("fxpipe", size, "meta"))]
        if size in args.real.split(","):
            jobs.append(("fxpipe", "cpu", ("fxpipe", size, "cpu")))
        if not args.no_pipelining:
            jobs.append(("pipelining", "meta", ("pipelining", size)))
        for tool, tensors, worker in jobs:
            print(f"{size} {tool} {tensors} ...", flush=True)
            r = _run_worker(*worker)
            r.update(size=size, tool=tool, tensors=tensors, params_b=params_b)
            print(
                "   ",
                {k: v for k, v in r.items() if k not in ("size", "tool", "tensors")},
                flush=True,
            )
            rows.append(r)
    scratch = Path(args.scratch)
    partition: list[dict] = []
    for size in [s for s in args.partition.split(",") if s]:
        import shutil

        out = scratch / f"partition-{size}"
        shutil.rmtree(out, ignore_errors=True)
        print(f"{size}: fxpipe partition --device meta ...", flush=True)
        p = _run_worker("partition", size, str(out))
        p.update(size=size, params_b=llama.parameter_count(size) / 1e9)
        print("   ", p, flush=True)
        partition.append(p)
        shutil.rmtree(out, ignore_errors=True)
    emit: list[dict] = []
    for size in [s for s in args.emit.split(",") if s]:
        folder = scratch / f"ckpt-{size}"
        print(f"{size}: writing a sharded checkpoint to {folder} ...", flush=True)
        checkpoint_bytes = write_checkpoint(size, folder)
        out = scratch / f"build-{size}"
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        print(f"{size}: emit ...", flush=True)
        e = _run_worker("emit", size, str(folder), str(out))
        e.update(size=size, checkpoint_bytes=checkpoint_bytes)
        print("   ", e, flush=True)
        emit.append(e)
        shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(folder, ignore_errors=True)
    if args.merge and (HERE / "results.json").exists():
        old = json.loads((HERE / "results.json").read_text())
        done = {(r["size"], r["tool"], r["tensors"]) for r in rows}
        rows = [r for r in old["rows"] if (r["size"], r["tool"], r["tensors"]) not in done] + rows
        emit = emit or old.get("emit", [])
        partition = partition or old.get("partition", [])
        order = {s: i for i, s in enumerate(llama.SHAPES)}
        rows.sort(key=lambda r: order[r["size"]])
    meta = {
        "machine": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "seq": llama.SEQ,
        "stages": STAGES,
    }
    (HERE / "results.json").write_text(
        json.dumps({"meta": meta, "rows": rows, "emit": emit, "partition": partition}, indent=2)
        + "\n"
    )
    (HERE / "results.md").write_text(_markdown(rows, emit, meta, partition))
    print((HERE / "results.md").read_text())


if __name__ == "__main__":
    main()
