"""A meta build of a transformers model without --weights: each stage runs the model's own ``_init_weights``."""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import pytest
import torch

from fxpipe.codegen import load_stage, write_build_dir
from fxpipe.codegen.pipeline import load_pipeline
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.tracer import trace_model_file

pytest.importorskip("transformers")

ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"


def _init_build(name: str, out: Path, stages: int = 2):
    """The zoo model ``name`` traced on meta and built without weights; its model file and manifest."""
    source = load_model_file(ZOO / f"{name}.py")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_model_file(source, 2, progress=False, trace_device="meta")
    plan = plan_partition(traced.profile, stages, microbatches=2)
    return source, write_build_dir(traced, plan, out, source, batch_size=4, microbatches=2)


def _stages(out: Path, n: int) -> list[dict[str, torch.Tensor]]:
    with warnings.catch_warnings():
        warnings.simplefilter(
            "error"
        )  # every tensor has the model's own initialiser: no fallback warning
        return [dict(load_stage(out, i).named_parameters(remove_duplicate=False)) for i in range(n)]


def _assert_like_the_model(stages: list[dict[str, torch.Tensor]], real: torch.nn.Module) -> int:
    """Every stage parameter has the statistics of the same parameter of the model initialised in one
    process by transformers: constants (norm weights, biases) exactly, random ones in mean and std."""
    reference = dict(real.named_parameters(remove_duplicate=False))
    checked = 0
    for params in stages:
        for key, t in params.items():
            ref = reference[key].detach()
            assert t.shape == ref.shape and t.dtype == ref.dtype, key
            if float(ref.std()) == 0.0:
                assert torch.equal(t.detach(), ref), key
            else:
                assert abs(float(t.std()) / float(ref.std()) - 1) < 0.2, (
                    key,
                    float(t.std()),
                    float(ref.std()),
                )
                assert abs(float(t.mean())) < 3 * float(ref.std()) / math.sqrt(t.numel()) + 1e-3, (
                    key
                )
            checked += 1
    return checked


def test_llama_stages_use_the_models_init_weights(tmp_path):
    source, manifest = _init_build("llama", tmp_path / "build")
    assert manifest.weights == "init"
    (spec,) = manifest.init_models
    assert spec.prefix == "" and spec.model_class.endswith(":LlamaForCausalLM")
    first, again = _stages(tmp_path / "build", 2), _stages(tmp_path / "build", 2)
    for a, b in zip(first, again):  # deterministic
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    real = source.build_model()
    assert _assert_like_the_model(first, real) == len(dict(real.named_parameters()))
    std = real.config.initializer_range
    q = first[0]["model.layers.0.self_attn.q_proj.weight"]
    # config.initializer_range, not nn.Linear's kaiming-uniform (std 1/sqrt(3 * 32) = 0.10)
    assert abs(float(q.std()) - std) < 0.2 * std
    embed = first[0]["model.embed_tokens.weight"]
    assert (
        not embed[real.config.pad_token_id].any() and abs(float(embed[1:].std()) - std) < 0.2 * std
    )
    with torch.no_grad():  # the stages run: finite outputs
        out = load_pipeline(tmp_path / "build")(*source.example_inputs(4))
    logits = (
        out["logits"] if isinstance(out, dict) else out[0] if isinstance(out, tuple) else out.logits
    )
    assert torch.isfinite(logits).all()


def test_gpt2_scaled_projections_and_tied_head(tmp_path):
    source, manifest = _init_build("gpt2", tmp_path / "build")
    (tie,) = manifest.ties
    stages = _stages(tmp_path / "build", 2)
    real = source.build_model()
    _assert_like_the_model(stages, real)
    n_layer, std = real.config.n_layer, real.config.initializer_range
    c_proj = stages[0]["transformer.h.0.attn.c_proj.weight"]
    assert abs(float(c_proj.std()) - std / math.sqrt(2 * n_layer)) < 0.2 * std / math.sqrt(
        2 * n_layer
    )
    assert not stages[0]["transformer.h.0.attn.c_attn.bias"].any()
    (s0, s1), (k0, k1) = tie.stages, tie.keys
    assert torch.equal(
        stages[s0][k0], stages[s1][k1]
    )  # tied copies identical, drawn as the embedding is
    assert abs(float(stages[s0][k0].std()) - std) < 0.2 * std
