"""Partition quality and solver time: fxpipe's plan vs the baselines and the lower bound.

Run: ``.venv/bin/python benchmarks/partition/run.py [--quick]``; writes results.json and
results.md next to this file. See README.md for what is measured.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from fxpipe.partitioner import build_problem, plan_partition, solve_chain_dp
from fxpipe.tracer.profile import ModelInfo, ModelProfile, TensorSpec, Unit, UnitEdge

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
EXAMPLES = ("mlp", "gpt", "resnet", "branchy")


def gpt2_small_profile(seq: int = 1024, microbatch: int = 1) -> ModelProfile:
    """A GPT-2-small-shaped chain (12 blocks, d=768, vocab 50257, tied embedding/head),
    with analytic times of 100 TFLOP/s-class hardware scaled to milliseconds."""
    d, vocab, tokens = 768, 50257, seq * microbatch
    act = tokens * d * 4
    flop_ms = 1.0 / 50e9  # ms per FLOP at an effective 50 TFLOP/s
    units: list[Unit] = []

    def add(
        name: str, path: str, flops: float, params: tuple[str, ...], act_bytes: int, out: int
    ) -> None:
        units.append(
            Unit(
                name=name,
                module_path=path,
                fwd_ms=flops * flop_ms,
                bwd_ms=2 * flops * flop_ms,
                params=params,
                activation_bytes=act_bytes,
                outputs=(TensorSpec((microbatch, out // (4 * microbatch))),),
            )
        )

    sizes = {"wte.weight": vocab * d * 4, "wpe.weight": seq * d * 4}
    add("embed", "transformer.wte", tokens * d, ("wte.weight", "wpe.weight"), act, act)
    for b in range(12):
        p = f"transformer.h.{b}"
        for name, n in (
            (f"{p}.attn.c_attn.weight", 3 * d * d),
            (f"{p}.attn.c_proj.weight", d * d),
            (f"{p}.mlp.c_fc.weight", 4 * d * d),
            (f"{p}.mlp.c_proj.weight", 4 * d * d),
        ):
            sizes[name] = n * 4
        add(
            f"h{b}.attn",
            f"{p}.attn",
            2 * tokens * 4 * d * d + 4 * tokens * seq * d,
            (f"{p}.attn.c_attn.weight", f"{p}.attn.c_proj.weight"),
            6 * act,
            act,
        )
        add(
            f"h{b}.mlp",
            f"{p}.mlp",
            2 * tokens * 8 * d * d,
            (f"{p}.mlp.c_fc.weight", f"{p}.mlp.c_proj.weight"),
            9 * act,
            act,
        )
    add(
        "lm_head",
        "lm_head",
        2 * tokens * d * vocab,
        ("lm_head.weight",),
        tokens * vocab * 4,
        tokens * vocab * 4,
    )
    edges = tuple(UnitEdge(units[i].name, units[i + 1].name, act) for i in range(len(units) - 1))
    return ModelProfile(
        units=tuple(units),
        edges=edges,
        batch_size=microbatch,
        param_sizes=sizes,
        ties=(("wte.weight", "lm_head.weight"),),
        model=ModelInfo(name="gpt2-small (synthetic)"),
    )


def unbalanced_chain(n: int = 48, seed: int = 0) -> ModelProfile:
    """A chain with a few very heavy units and uneven edge sizes, where greedy heuristics err."""
    rng = random.Random(seed)
    units = tuple(
        Unit(
            name=f"u{i}",
            module_path=f"layers.{i}",
            fwd_ms=(rng.uniform(4, 9) if i % 11 == 3 else rng.uniform(0.2, 1.5)),
            bwd_ms=(rng.uniform(8, 18) if i % 11 == 3 else rng.uniform(0.4, 3.0)),
            param_bytes=rng.randint(1, 40) * 2**20,
            activation_bytes=2**20,
        )
        for i in range(n)
    )
    edges = tuple(
        UnitEdge(f"u{i}", f"u{i + 1}", rng.choice([2**16, 2**20, 2**24])) for i in range(n - 1)
    )
    return ModelProfile(
        units=units, edges=edges, batch_size=1, model=ModelInfo(name="unbalanced chain")
    )


def traced_examples() -> dict[str, ModelProfile]:
    """Profiles of the bundled examples and of GPT-2 small (Hugging Face, traced with
    torch.export at batch 1, sequence 128), as ``fxpipe trace`` makes them."""
    from fxpipe.modelfile import load_model_file
    from fxpipe.tracer.api import trace_model_file

    out = {
        name: trace_model_file(load_model_file(ROOT / "examples" / f"{name}.py"), 4).profile
        for name in EXAMPLES
    }
    hf = load_model_file(
        ROOT / "examples" / "hf_models.py",
        model_fn="build_gpt2_small",
        inputs_fn="gpt2_small_inputs",
    )
    out["gpt2-small (traced)"] = trace_model_file(hf, 1).profile
    return out


def quality(
    profiles: dict[str, ModelProfile], stages: tuple[int, ...], time_limit: float
) -> list[dict]:
    rows = []
    for name, profile in profiles.items():
        for S in stages:
            if S > len(profile.units):
                continue
            plan = plan_partition(profile, S, microbatches=2 * S, time_limit=time_limit)
            row = {
                "model": name,
                "units": len(profile.units),
                "stages": S,
                "solver": plan.solver,
                "optimal": plan.optimal,
                "bottleneck_ms": plan.bottleneck_ms,
                "lower_bound_ms": plan.lower_bound_ms,
                "plan_over_bound": plan.bottleneck_ms / plan.lower_bound_ms
                if plan.lower_bound_ms
                else 1.0,
                "plan_over_compute_bound": plan.bottleneck_ms
                / max(v for k, v in plan.lower_bounds.items() if not k.endswith("_proven")),
                "solve_seconds": plan.solve_seconds,
            }
            for base, b in plan.baselines.items():
                row[f"{base}_over_plan"] = (
                    b.bottleneck_ms / plan.bottleneck_ms if plan.bottleneck_ms else 1.0
                )
            rows.append(row)
    return rows


def solver_times(sizes: tuple[int, ...], stages: tuple[int, ...]) -> list[dict]:
    rows = []
    for n in sizes:
        rng = random.Random(n)
        units = tuple(
            Unit(
                name=f"u{i}",
                module_path=f"m.{i}",
                fwd_ms=rng.uniform(0.1, 2),
                bwd_ms=rng.uniform(0.2, 4),
                param_bytes=rng.randint(0, 2**20),
                activation_bytes=2**16,
            )
            for i in range(n)
        )
        edges = tuple(
            UnitEdge(f"u{i}", f"u{i + 1}", rng.randint(2**10, 2**22)) for i in range(n - 1)
        )
        profile = ModelProfile(units=units, edges=edges, batch_size=1)
        for S in stages:
            problem = build_problem(profile, S)
            start = time.perf_counter()
            solve_chain_dp(problem)
            rows.append({"units": n, "stages": S, "dp_seconds": time.perf_counter() - start})
    return rows


def cpsat_chain_time(n: int = 300, S: int = 8, time_limit: float = 30.0) -> dict:
    from fxpipe.partitioner import solve_dag_cpsat

    rng = random.Random(7)
    units = tuple(
        Unit(
            name=f"u{i}",
            module_path=f"m.{i}",
            fwd_ms=rng.uniform(0.1, 2),
            bwd_ms=rng.uniform(0.2, 4),
        )
        for i in range(n)
    )
    edges = tuple(UnitEdge(f"u{i}", f"u{i + 1}", rng.randint(2**10, 2**22)) for i in range(n - 1))
    problem = build_problem(ModelProfile(units=units, edges=edges, batch_size=1), S)
    dp = solve_chain_dp(problem)
    cold = solve_dag_cpsat(problem, time_limit=time_limit, workers=2)
    warm = solve_dag_cpsat(problem, hint=dp.assignment, time_limit=time_limit, workers=2)
    return {
        "units": n,
        "stages": S,
        "dp_seconds": dp.seconds,
        "cpsat_cold_seconds": cold.seconds,
        "cpsat_cold_optimal": cold.optimal,
        "cpsat_warm_seconds": warm.seconds,
        "cpsat_warm_optimal": warm.optimal,
    }


def write_markdown(results: dict, path: Path) -> None:
    lines = [
        "# Partition benchmark",
        "",
        f"Generated by `benchmarks/partition/run.py` in {results['seconds']:.1f} s.",
        "",
        "## Plan quality (bottleneck ratios; baselines / plan > 1 means fxpipe is faster)",
        "",
        "| model | units | S | solver | optimal | bottleneck ms | plan / bound | plan / compute bound | uniform / plan | params / plan "
        "| greedy / plan | solve s |",
        "|---|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results["quality"]:
        lines.append(
            f"| {r['model']} | {r['units']} | {r['stages']} | {r['solver']} | {r['optimal']} | "
            f"{r['bottleneck_ms']:.3f} | {r['plan_over_bound']:.4f} | {r['plan_over_compute_bound']:.3f} | "
            f"{r['uniform_over_plan']:.3f} | "
            f"{r['params_over_plan']:.3f} | {r['greedy_over_plan']:.3f} | {r['solve_seconds']:.2f} |"
        )
    lines += [
        "",
        "## DP solver time on synthetic chains",
        "",
        "| units | stages | DP seconds |",
        "|---:|---:|---:|",
    ]
    lines += [
        f"| {r['units']} | {r['stages']} | {r['dp_seconds']:.3f} |" for r in results["solver_time"]
    ]
    c = results.get("cpsat_chain")
    if c:
        lines += [
            "",
            "## CP-SAT on a chain",
            "",
            f"{c['units']} units into {c['stages']} stages: DP {c['dp_seconds']:.3f} s; CP-SAT cold "
            f"{c['cpsat_cold_seconds']:.2f} s (optimal {c['cpsat_cold_optimal']}), warm-started from the DP "
            f"{c['cpsat_warm_seconds']:.2f} s (optimal {c['cpsat_warm_optimal']}).",
        ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, no tracing")
    args = parser.parse_args()
    start = time.perf_counter()
    profiles = {"gpt2-small (synthetic)": gpt2_small_profile(), "unbalanced": unbalanced_chain()}
    if not args.quick:
        profiles.update(traced_examples())
    results = {
        "quality": quality(profiles, (2, 4, 8), time_limit=5.0 if args.quick else 20.0),
        "solver_time": solver_times((1000,) if args.quick else (1000, 2000, 5000), (8, 64)),
        "cpsat_chain": None if args.quick else cpsat_chain_time(),
    }
    results["seconds"] = time.perf_counter() - start
    (HERE / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    write_markdown(results, HERE / "results.md")
    print((HERE / "results.md").read_text())


if __name__ == "__main__":
    main()
