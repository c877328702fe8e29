"""Schedules benchmark: fxpipe's 1F1B, interleaved 1F1B, ZB-H1 and ZBV against torch.distributed.pipelining.

    .venv/bin/python benchmarks/runtime/bench_schedules.py [--steps 20] [--model gpt_medium] [--out benchmarks/runtime]

For each microbatch count M in (S, 2S) on S = 2 ranks it traces the model once (unit times
measured with one thread, as each worker runs) and plans one build per schedule (interleaved
and ZBV with 2 stages per rank). Then one torchrun job (2 ranks, gloo, CPU) times, for each
build, fxpipe's ``PipelineRunner`` and the peer schedule (``Schedule1F1B``,
``ScheduleInterleaved1F1B``, ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``)
driving ``PipelineStage``s that wrap the SAME ``load_stage`` modules of this rank, alternately
step by step, each step between two barriers. Both sum tied gradients (fxpipe by itself, the
peer loop by hand) and both start from the same weights. Reported: median step of each and the
ratio fxpipe / peer; fxpipe's measured bubble (1 - the ranks' compute time / (ranks x step)),
from the executor's per-action times) and step against fxpipe's 1F1B at the same M; and the
plan's predicted step against the measured one. Writes ``schedules.json`` and ``schedules.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MODELS = {"gpt_medium": ROOT / "benchmarks" / "runtime" / "gpt_medium.py", "gpt": ROOT / "examples" / "gpt.py"}
RANKS, BATCH, LR = 2, 16, 0.01
SCHEDULES = ("1f1b", "interleaved-1f1b", "zb-h1", "zbv")
PEERS = {"1f1b": "Schedule1F1B", "interleaved-1f1b": "ScheduleInterleaved1F1B",
         "zb-h1": "ScheduleInterleavedZeroBubble", "zbv": "ScheduleZBVZeroBubble"}


def _build(model_file: Path, root: Path, microbatches: int) -> None:
    """One trace, one build per schedule (each planned for its own step time)."""
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    torch.set_num_threads(1)
    source = load_model_file(model_file)
    traced = trace_model_file(source, BATCH // microbatches, measure_times=True)
    for name in SCHEDULES:
        plan = plan_partition(traced.profile, RANKS, microbatches=microbatches, schedule=name)
        write_build_dir(traced, plan, root / f"{name}-m{microbatches}", source, batch_size=BATCH,
                        microbatches=microbatches)


class _PeerStage(torch.nn.Module):
    """An fxpipe stage as the peer needs it: the last stage's 1-tuple unwrapped (pipelining hands the
    raw output to loss_fn), and, for its split backward, the outputs copied (``clone``): it calls
    ``detach_`` on every output, which fails on a view and breaks the backward of any op inside the
    stage that saved that tensor (GPT's residual stream). fxpipe's runtime needs neither."""

    def __init__(self, inner: torch.nn.Module, unwrap: bool, copy_outputs: bool) -> None:
        super().__init__()
        self.inner, self.unwrap, self.copy_outputs = inner, unwrap, copy_outputs

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        out = self.inner(*args)
        outs = tuple(out) if isinstance(out, (tuple, list)) else (out,)
        if self.copy_outputs:
            outs = tuple(o.clone() for o in outs)
        return outs[0] if self.unwrap and len(outs) == 1 else outs


def _peer(build_dir: Path, name: str, microbatches: int, source, rank: int):
    """The peer's schedule over PipelineStages wrapping this rank's load_stage modules; a step function."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pp

    from fxpipe.codegen import load_stage
    from fxpipe.codegen.manifest import Manifest

    manifest = Manifest.from_json(build_dir)
    mine = [s for s, r in enumerate(manifest.stage_ranks) if r == rank]
    modules = {s: load_stage(build_dir, s) for s in mine}
    last = manifest.num_stages - 1
    split = name in ("zb-h1", "zbv")
    stages = [pp.PipelineStage(_PeerStage(modules[s], s == last, split), s, manifest.num_stages, torch.device("cpu"))
              for s in mine]
    cls = getattr(pp, PEERS[name])
    sched = cls(stages[0] if len(stages) == 1 and name == "1f1b" else stages, n_microbatches=microbatches,
                loss_fn=source.loss_fn)
    params = [p for m in modules.values() for p in m.parameters()]
    opt = torch.optim.SGD(params, lr=LR)
    # Tied parameters (GPT's wte/lm_head): sum every copy's gradient (fxpipe does this by itself)
    shapes = {(s, k): p.shape for s in modules for k, p in modules[s].named_parameters()}
    ties = []
    for t in manifest.ties:
        copies = [modules[s].get_parameter(k) for s, k in zip(t.stages, t.keys) if s in modules]
        spans = len({manifest.stage_ranks[s] for s in t.stages}) > 1
        shape = next((shapes[(s, k)] for s, k in zip(t.stages, t.keys) if (s, k) in shapes), None)
        ties.append((copies, spans, shape))
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)

    def step() -> None:
        opt.zero_grad()
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets, "losses": losses} if last in mine else {}
        args = inputs if 0 in mine else ()
        sched.step(*args, **kwargs)
        for copies, spans, shape in ties:   # every copy gets the sum of all copies' gradients
            total = sum(p.grad for p in copies).clone() if copies else torch.zeros(shape or ())
            if spans:
                dist.all_reduce(total)
            for p in copies:
                p.grad = total.clone()
        opt.step()

    return step


def _worker(root: Path, steps: int, model_file: Path) -> None:
    """Run under torchrun: every build, fxpipe and the peer alternating steps."""
    import torch.distributed as dist

    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    source = load_model_file(model_file)
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    out = {}
    for build_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        name, m = build_dir.name.rsplit("-m", 1)
        M = int(m)
        fx = PipelineRunner(build_dir, source.loss_fn, microbatches=M,
                            optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR))
        peer = _peer(build_dir, name, M, source, rank)
        times: dict[str, list[float]] = {"fxpipe": [], "peer": []}
        busy: list[float] = []
        for _ in range(3):
            fx.step(inputs, targets)
            peer()
        for _ in range(steps):
            for label, fn in (("fxpipe", lambda: fx.step(inputs, targets)), ("peer", peer)):
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                dist.barrier()
                times[label].append(time.perf_counter() - t0)
                if label == "fxpipe":
                    busy.append(sum(a.end - a.start for a in fx.executor.last_step))
        gathered: list = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, {"times": times, "busy": busy})
        out[build_dir.name] = gathered
        fx.close()
    if rank == 0:
        (root / "schedules_raw.json").write_text(json.dumps(out))
    dist.destroy_process_group()


def _summary(root: Path) -> list[dict]:
    from fxpipe.partitioner import PartitionPlan

    raw = json.loads((root / "schedules_raw.json").read_text())
    rows = []
    for key, per_rank in sorted(raw.items()):
        name, m = key.rsplit("-m", 1)
        plan = PartitionPlan.from_json(root / key / "plan.json")
        fx = [statistics.median(r["times"]["fxpipe"]) * 1e3 for r in per_rank]
        pp = [statistics.median(r["times"]["peer"]) * 1e3 for r in per_rank]
        step_ms, peer_ms = max(fx), max(pp)
        # per step, each rank's compute time over the step (the same steps: alternate runs of fxpipe)
        bubbles = []
        for k in range(len(per_rank[0]["busy"])):
            wall = max(r["times"]["fxpipe"][k] for r in per_rank)
            bubbles.append(1.0 - sum(r["busy"][k] for r in per_rank) / (len(per_rank) * wall))
        pred = plan.predicted_step_ms(name, microbatches=int(m))
        rows.append({"schedule": name, "microbatches": int(m), "virtual_stages": plan.virtual_stages,
                     "fxpipe_step_ms": step_ms, "peer": PEERS[name], "peer_step_ms": peer_ms,
                     "fxpipe_over_peer": step_ms / peer_ms, "measured_bubble": statistics.median(bubbles),
                     "predicted_bubble": plan.prediction.bubble if plan.prediction else None,
                     "predicted_step_ms": pred, "measured_over_predicted": step_ms / pred if pred else None,
                     "stage_ranks": list(plan.stage_ranks)})
    base = {r["microbatches"]: r["fxpipe_step_ms"] for r in rows if r["schedule"] == "1f1b"}
    for r in rows:
        r["step_over_1f1b"] = r["fxpipe_step_ms"] / base[r["microbatches"]]
    return rows


def _markdown(rows: list[dict], model: str, steps: int) -> str:
    lines = [f"# Schedules benchmark ({model}, batch {BATCH}, {RANKS} ranks)", "",
             f"gloo on 127.0.0.1, CPU, one thread per rank, SGD; medians over {steps} timed steps, fxpipe and "
             "the peer alternating, each step between barriers. See README.md for the method.", "",
             "| schedule | M | V | fxpipe ms | peer | peer ms | fxpipe / peer | bubble (measured) | "
             "bubble (predicted) | step / fxpipe 1f1b | predicted ms | measured / predicted |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["microbatches"], SCHEDULES.index(r["schedule"]))):
        pred = f"{r['predicted_step_ms']:.2f}" if r["predicted_step_ms"] else "n/a"
        ratio = f"{r['measured_over_predicted']:.2f}" if r["measured_over_predicted"] else "n/a"
        pb = f"{r['predicted_bubble']:.1%}" if r["predicted_bubble"] is not None else ""
        lines.append(f"| {r['schedule']} | {r['microbatches']} | {r['virtual_stages']} | {r['fxpipe_step_ms']:.2f} | "
                     f"{r['peer']} | {r['peer_step_ms']:.2f} | {r['fxpipe_over_peer']:.2f} | "
                     f"{r['measured_bubble']:.1%} | {pb} | {r['step_over_1f1b']:.2f} | {pred} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--build", "--worker"):
        mode, rest = sys.argv[1], sys.argv[2:]
        if mode == "--build":
            _build(Path(rest[0]), Path(rest[1]), int(rest[2]))
        else:
            _worker(Path(rest[0]), int(rest[1]), Path(rest[2]))
        return
    from fxpipe.runtime.launch import free_port

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model", choices=sorted(MODELS), default="gpt_medium")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent)
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    py, model_file = sys.executable, MODELS[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        for m in (RANKS, 2 * RANKS):
            subprocess.run([py, __file__, "--build", str(model_file), str(root), str(m)], check=True)
        subprocess.run([py, "-m", "torch.distributed.run", "--nproc-per-node", str(RANKS), "--rdzv-backend", "c10d",
                        "--rdzv-endpoint", f"127.0.0.1:{free_port()}", __file__, "--worker", str(root),
                        str(args.steps), str(model_file)], check=True)
        rows = _summary(root)
    meta = {"torch": torch.__version__, "cpu_count": os.cpu_count(), "steps": args.steps, "model": args.model,
            "load_average": os.getloadavg(), "note": "shared 2-core machine; other jobs may have been running"}
    (args.out / "schedules.json").write_text(json.dumps({"meta": meta, "results": rows}, indent=1) + "\n")
    text = _markdown(rows, args.model, args.steps)
    (args.out / "schedules.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
