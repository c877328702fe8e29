"""Rebuilt modules equal the original in their whole configuration (Note [rebuilt modules equal the original]
in fxpipe.tracer.construct.rebuild), the symbolic leaf policy keeps whole only what can be rebuilt, and ``auto``
picks the front end whose graph a stage file can build."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from pipeline_support import MODELS, assert_pipeline_matches, partition_file

from fxpipe.tracer import trace_model
from fxpipe.tracer.construct.rebuild import (
    build_on_meta,
    configuration_difference,
    drop_redundant,
    rebuild_problem,
    torch_nn_arguments,
)


def test_multihead_attention_keeps_batch_first_and_dropout() -> None:
    mha = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
    args, kwargs = drop_redundant(mha, *torch_nn_arguments(mha))
    assert args == (32, 4) and kwargs == {"dropout": 0.1, "batch_first": True}
    assert configuration_difference(mha, build_on_meta(nn.MultiheadAttention, args, kwargs)) is None
    partial = build_on_meta(nn.MultiheadAttention, (32, 4), {})  # same parameters, same repr
    assert repr(partial) == repr(mha)
    assert configuration_difference(mha, partial) == "batch_first = False, expected True"


@pytest.mark.parametrize(
    "original,rebuilt,difference",
    [
        (nn.Linear(3, 4), nn.Linear(3, 4, bias=False), "parameters or buffers differ"),
        (nn.BatchNorm1d(4, momentum=0.3), nn.BatchNorm1d(4), "momentum = 0.1, expected 0.3"),
        (nn.Sequential(nn.Dropout(0.1)), nn.Sequential(nn.Dropout(0.2)), "0.p = 0.2, expected 0.1"),
        (nn.GELU(approximate="tanh"), nn.GELU(), "approximate = 'none', expected 'tanh'"),
        (
            nn.Conv1d(2, 2, 3, padding=1, padding_mode="circular"),
            nn.Conv1d(2, 2, 3, padding=1),
            "padding_mode",
        ),
    ],
)
def test_configuration_differences_are_named(
    original: nn.Module, rebuilt: nn.Module, difference: str
) -> None:
    assert difference in str(configuration_difference(original, rebuilt))


def test_hooks_and_instance_forwards_count_foreign_markers_do_not() -> None:
    hooked = nn.Linear(3, 4)
    hooked.register_forward_hook(lambda m, i, o: o * 2)
    assert "hooks" in str(rebuild_problem(hooked))
    patched = nn.Linear(3, 4)
    patched.forward = functools.partial(torch.nn.functional.linear, weight=patched.weight)  # type: ignore
    assert "forward" in str(rebuild_problem(patched))
    marked = nn.LayerNorm(4)
    marked._is_hf_initialized = True  # what transformers puts on every module
    marked.note = "set by a user; torch's forward never reads it"
    assert rebuild_problem(marked) is None


class Scaled(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x) * self.scale


def test_user_classes_need_recorded_literal_arguments_and_every_attribute() -> None:
    module = Scaled(4)
    assert rebuild_problem(module, None) == "no constructor arguments were recorded for it"
    assert rebuild_problem(module, ((4,), {})) is None
    module.scale = (
        3.0  # set by its parent after construction: the rebuilt one would compute another function
    )
    assert rebuild_problem(module, ((4,), {})) == "scale = 1.0, expected 3.0"
    assert "cannot be written" in str(rebuild_problem(Scaled(4), ((nn.Linear(4, 4),), {})))


class WithEncoderLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.layer = nn.TransformerEncoderLayer(8, 2, 16, 0.0, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer(self.proj(x))


def test_symbolic_traces_into_a_torch_nn_module_it_cannot_rebuild() -> None:
    # TransformerEncoderLayer does not store d_model: not a leaf; tracing into it fails on its fast-path
    # checks, so it ends up kept whole, and auto takes the export graph instead
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        traced = trace_model(WithEncoderLayer(), (torch.randn(2, 5, 8),), progress=False)
    assert traced.frontend == "export"
    assert not [w for w in caught if "fxpipe" in str(w.message)]
    symbolic = trace_model(
        WithEncoderLayer(), (torch.randn(2, 5, 8),), frontend="symbolic", progress=False
    )
    assert "layer" in symbolic.leaf_modules and "proj" in symbolic.leaf_modules


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mha = nn.MultiheadAttention(8, 2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mha(self.norm(x), x, x, need_weights=False)[0]


def test_rebuildable_torch_nn_layers_stay_leaves_of_the_symbolic_graph() -> None:
    traced = trace_model(Mixer(), (torch.randn(2, 5, 8),), progress=False)
    assert traced.frontend == "symbolic"
    assert set(traced.leaf_modules) == {"norm", "mha"}


@pytest.mark.parametrize("stages", [2, 4])
def test_transformer_encoder_with_the_default_front_end(tmp_path: Path, stages: int) -> None:
    traced, source = partition_file(MODELS / "transformer_encoder.py", stages, tmp_path / "build")
    assert traced.frontend == "export" and len(traced.profile.units) >= stages
    assert_pipeline_matches(tmp_path / "build", source, training=True)


@pytest.mark.parametrize(
    "factory,modes", [("build_model", (True,)), ("build_without_dropout", (True, False))]
)
def test_multihead_attention_with_batch_first_and_dropout_matches(
    tmp_path: Path, factory: str, modes: tuple[bool, ...]
) -> None:
    traced, source = partition_file(f"{MODELS / 'mha_vit.py'}:{factory}", 2, tmp_path / "build")
    assert traced.frontend == "symbolic"
    text = "".join(p.read_text() for p in sorted((tmp_path / "build").glob("stage_*.py")))
    dropout = ", dropout=0.1" if factory == "build_model" else ""
    assert f"torch.nn.MultiheadAttention(16, 4{dropout}, batch_first=True)" in text
    for training in modes:
        assert_pipeline_matches(tmp_path / "build", source, training=training)
