"""``transformer_profile``: a decoder-only transformer's ``ModelProfile`` from its dimensions alone.

For planning a model nobody has traced here (what-if studies of a 70B model on 1,024
devices) and as the fixture of the cluster search's tests and benchmark. Units: the
token embedding, one per block, and the head (final norm + output projection). Per
microbatch of ``batch`` sequences of ``seq`` tokens (T tokens):

* forward FLOPs of a block: ``2 T x block parameters + 2 T seq hidden`` (the causal
  attention's scores and weighted sum, half of the full square); backward twice that,
  half of it weight gradients; times at ``device_tflops`` effective;
* activations saved for backward (bf16, flash attention):
  ``T (12 hidden + 4 kv_hidden + 8 ffn)`` bytes per block; the head keeps its fp32 logits;
* parameters in fp32 (the cost model's optimizer factor prices their state), each with
  its shape; the activation a block hands on is ``T x hidden`` bf16.

>>> p = llama3_70b_profile()
>>> round(p.total_param_bytes / 4 / 1e9, 1), len(p.units)
(70.6, 82)
"""

from __future__ import annotations

from fxpipe.tracer.profile import ModelInfo, ModelProfile, TensorSpec, Unit, UnitEdge

__all__ = ["transformer_profile", "llama3_70b_profile"]

_FP32 = 4


def transformer_profile(
    *,
    layers: int,
    hidden: int,
    ffn: int,
    heads: int,
    kv_heads: int,
    vocab: int,
    seq: int,
    batch: int = 1,
    device_tflops: float = 400.0,
    name: str = "transformer",
) -> ModelProfile:
    """The profile of a Llama-style decoder (SwiGLU MLP, grouped-query attention, untied head)."""
    tokens = batch * seq
    kv_hidden = hidden * kv_heads // heads
    per_ms = 1.0 / (device_tflops * 1e12) * 1e3
    shapes = {
        "attn.wq": (hidden, hidden),
        "attn.wk": (kv_hidden, hidden),
        "attn.wv": (kv_hidden, hidden),
        "attn.wo": (hidden, hidden),
        "mlp.w1": (ffn, hidden),
        "mlp.w3": (ffn, hidden),
        "mlp.w2": (hidden, ffn),
        "attn_norm": (hidden,),
        "mlp_norm": (hidden,),
    }
    block_params = sum(_numel(s) for s in shapes.values())
    act = TensorSpec((batch, seq, hidden), "bfloat16")
    param_sizes: dict[str, int] = {}
    param_shapes: dict[str, tuple[int, ...]] = {}

    def unit(
        uname: str,
        path: str,
        fwd_flops: float,
        params: dict[str, tuple[int, ...]],
        activation: int,
        out: TensorSpec,
    ) -> Unit:
        names = tuple(f"{path}.{k}" for k in params)
        for full, shape in zip(names, params.values()):
            param_sizes[full] = _numel(shape) * _FP32
            param_shapes[full] = shape
        fwd = fwd_flops * per_ms
        return Unit(
            name=uname,
            module_path=path,
            kind="module",
            module_type=uname.split("_")[0],
            outputs=(out,),
            fwd_ms=fwd,
            bwd_ms=2 * fwd,
            fwd_flops=fwd_flops,
            param_bytes=sum(param_sizes[n] for n in names),
            activation_bytes=activation,
            params=names,
            weight_grad_fraction=0.5,
        )

    units = [unit("embed", "tok_embeddings", 0.0, {"weight": (vocab, hidden)}, 0, act)]
    block_flops = 2.0 * tokens * block_params + 2.0 * tokens * seq * hidden
    block_act = tokens * (12 * hidden + 4 * kv_hidden + 8 * ffn)
    for i in range(layers):
        units.append(unit(f"layers_{i}", f"layers.{i}", block_flops, shapes, block_act, act))
    units.append(
        unit(
            "head",
            "output",
            2.0 * tokens * vocab * hidden,
            {"norm": (hidden,), "weight": (vocab, hidden)},
            tokens * (2 * hidden + _FP32 * vocab),
            TensorSpec((batch, seq, vocab), "float32"),
        )
    )
    edges = tuple(
        UnitEdge(units[i].name, units[i + 1].name, act.nbytes) for i in range(len(units) - 1)
    )
    return ModelProfile(
        units=tuple(units),
        edges=edges,
        batch_size=batch,
        trace_device="cuda",
        frontend="synthetic",
        timing="analytic",
        module_order=tuple(u.module_path for u in units),
        param_sizes=param_sizes,
        param_shapes=param_shapes,
        model=ModelInfo(name=name),
    )


def llama3_70b_profile(
    *, seq: int = 4096, batch: int = 1, device_tflops: float = 400.0
) -> ModelProfile:
    """Llama-3-70B's shape: 80 blocks, hidden 8192, SwiGLU 28672, 64 heads (8 KV), vocabulary 128256."""
    return transformer_profile(
        layers=80,
        hidden=8192,
        ffn=28672,
        heads=64,
        kv_heads=8,
        vocab=128256,
        seq=seq,
        batch=batch,
        device_tflops=device_tflops,
        name="llama3-70b (synthetic)",
    )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n
