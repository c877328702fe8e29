"""Synthetic GPT-like profiles of any size for the report tests (35, 154, 2,000+ units)."""

from __future__ import annotations

from fxpipe.tracer.profile import ModelProfile, TensorSpec, Unit, UnitEdge

_LAYER = (
    ("ln_1", "LayerNorm", 0.05),
    ("attn.c_attn", "Linear", 0.6),
    ("attn", "ops", 0.4),
    ("attn.c_proj", "Linear", 0.2),
    ("", "ops", 0.02),
    ("ln_2", "LayerNorm", 0.05),
    ("mlp.c_fc", "Linear", 0.8),
    ("mlp.act", "GELU", 0.1),
    ("mlp.c_proj", "Linear", 0.8),
    ("mlp.dropout", "Dropout", 0.02),
    ("", "ops", 0.02),
    ("attn.dropout", "Dropout", 0.02),
)


def gpt_like_profile(num_units: int, head_ms: float = 6.0) -> ModelProfile:
    """``num_units`` units in a chain (skip edges inside each block): ``wte``, ``wpe``, blocks ``h.i`` of
    12 units (the last one cut short), ``ln_f`` and a heavy ``lm_head`` (GPT-2's bottleneck)."""
    specs = [("wte", "Embedding", 0.3), ("wpe", "Embedding", 0.05)]
    while len(specs) < num_units - 2:
        i = (len(specs) - 2) // len(_LAYER)
        sub, kind, ms = _LAYER[(len(specs) - 2) % len(_LAYER)]
        specs.append((f"h.{i}.{sub}" if sub else f"h.{i}", kind, ms * (1 + 0.1 * (i % 3))))
    specs += [("ln_f", "LayerNorm", 0.05), ("lm_head", "Linear", head_ms)]
    seen: dict[str, int] = {}
    units = []
    for path, kind, ms in specs:
        n = seen.get(path, 0)
        seen[path] = n + 1
        units.append(
            Unit(
                name=path if n == 0 else f"{path}#{n}",
                module_path=path,
                module_type=kind,
                kind="ops" if kind == "ops" else "leaf",
                fwd_ms=ms / 3,
                bwd_ms=2 * ms / 3,
                param_bytes=4096 if kind == "Linear" else 0,
                activation_bytes=2048,
                outputs=(TensorSpec((2, 64, 96)),),
            )
        )
    edges = [UnitEdge(a.name, b.name, 2 * 64 * 96 * 4) for a, b in zip(units, units[1:])]
    edges += [
        UnitEdge(units[i].name, units[i + 5].name, 2 * 64 * 96 * 4)
        for i in range(2, len(units) - 5, len(_LAYER))
    ]
    return ModelProfile(units=tuple(units), edges=tuple(edges), batch_size=2)
