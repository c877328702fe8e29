"""Fallback to leaves, user-named leaves, constructor-argument capture and ``fxpipe.partition`` pins."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from example_models import EXAMPLES
from fxpipe.errors import PinError, TraceError
from fxpipe.modelfile import load_model_file
from fxpipe.tracer import build_model_recorded, partition, trace_model, trace_model_file


def test_gpt_attention_falls_back_to_leaf_with_warning():
    source = load_model_file(EXAMPLES["gpt"])
    with pytest.warns(
        UserWarning, match=r"'blocks\.0\.attn', .*'blocks\.3\.attn' \(CausalSelfAttention\).*leaf"
    ) as caught:
        traced = trace_model_file(source, batch_size=2, progress=False)
    # one warning for the four blocks (one cause), pointing at the failing line of the user's model file
    fallback = [w for w in caught if "symbolic tracing failed" in str(w.message)]
    assert len(fallback) == 1 and fallback[0].filename == str(EXAMPLES["gpt"])
    assert (
        "self.mask[:, :, :t, :t]"
        in Path(fallback[0].filename).read_text().splitlines()[fallback[0].lineno - 1]
    )
    assert traced.frontend == "symbolic"
    attn = [p for p in traced.leaf_modules if p.endswith(".attn")]
    assert attn == [f"blocks.{i}.attn" for i in range(4)]
    # constructor args of the user-defined leaf are recorded for codegen
    assert traced.user_leaf_args["blocks.0.attn"] == ((32, 4, 16), {})
    assert "blocks.0.ln_1" not in traced.user_leaf_args  # torch.nn leaves need none
    units = {u.module_path: u for u in traced.profile.units}
    assert (
        units["blocks.2.attn"].kind == "leaf"
        and units["blocks.2.attn"].module_type == "CausalSelfAttention"
    )


def test_user_named_leaves_by_type_and_path():
    source = load_model_file(EXAMPLES["gpt"])
    model = source.build_model()
    attn_type = type(model.blocks[0].attn)
    mlp_type = type(model.blocks[0].mlp)
    traced = trace_model(
        model, source.example_inputs(2), leaves=(attn_type, "blocks.1.mlp"), progress=False
    )
    assert "blocks.1.mlp" in traced.leaf_modules and "blocks.0.mlp" not in traced.leaf_modules
    assert traced.leaf_modules["blocks.1.mlp"] is mlp_type
    assert traced.leaf_modules["blocks.3.attn"] is attn_type


class _Pinned(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        with partition(0):
            self.embed = nn.Linear(8, 8)
        self.middle = nn.Sequential(nn.Linear(8, 8), nn.ReLU())
        with partition(1):
            self.tail = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
            with partition(2):
                self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.tail(self.middle(self.embed(x))))


def test_pins_reach_units_innermost_wins():
    model, record = build_model_recorded(_Pinned)
    assert record.pins == {"embed": 0, "tail": 1, "tail.0": 1, "tail.1": 1, "head": 2}
    traced = trace_model(model, (torch.randn(4, 8),), build_record=record, progress=False)
    pins = {u.module_path: u.pin for u in traced.profile.units}
    assert pins == {
        "embed": 0,
        "middle.0": None,
        "middle.1": None,
        "tail.0": 1,
        "tail.1": 1,
        "head": 2,
    }
    # pins are found from the module objects too, without a build record
    assert [
        u.pin for u in trace_model(_Pinned(), (torch.randn(4, 8),), progress=False).profile.units
    ] == [0, None, None, 1, 1, 2]


def test_partition_rejects_bad_index():
    with pytest.raises(PinError, match="-1"):
        with partition(-1):
            pass


def test_construction_hook_keeps_modules_constructible():
    with partition(0):
        pass
    assert nn.Linear(2, 3).weight.shape == (3, 2)  # constructor arguments still reach __init__


class _Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum().item() > 0:  # data-dependent: neither front end can trace it
            return self.lin(x)
        return -self.lin(x)


def test_both_front_ends_failing_raises_trace_error():
    with pytest.raises(TraceError, match=r"symbolic \(torch\.fx\).*\n.*export.*\n.*leaf"):
        trace_model(_Untraceable(), (torch.randn(2, 4),), progress=False)


def test_bad_arguments_raise_actionable_errors():
    with pytest.raises(TraceError, match="'gpu'.*cpu"):
        trace_model(nn.Linear(2, 2), (torch.randn(2, 2),), trace_device="gpu")
    with pytest.raises(TraceError, match="'magic'"):
        trace_model(nn.Linear(2, 2), (torch.randn(2, 2),), frontend="magic")
    with pytest.raises(TraceError, match="no argument is a tensor"):
        trace_model(nn.Linear(2, 2), ([1.0, 2.0],))
