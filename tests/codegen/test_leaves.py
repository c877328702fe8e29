"""Leaf module constructors and literal rendering."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from fxpipe.codegen.render.leaf_constructors import leaf_constructor
from fxpipe.codegen.render.pyrender import ImportTable, attr_expr, render_literal
from fxpipe.errors import CodegenError


@pytest.mark.parametrize(
    "module,expected",
    [
        (nn.Linear(4, 8, bias=False), "torch.nn.Linear(4, 8, bias=False)"),
        (
            nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False),
            "torch.nn.Conv2d(3, 8, (3, 3), stride=(2, 2), padding=(1, 1), bias=False)",
        ),
        (
            nn.BatchNorm1d(6, momentum=0.3, affine=False),
            "torch.nn.BatchNorm1d(6, momentum=0.3, affine=False)",
        ),
        (nn.LayerNorm(5, eps=1e-6, bias=False), "torch.nn.LayerNorm((5,), eps=1e-06, bias=False)"),
        (nn.Embedding(10, 4, padding_idx=0), "torch.nn.Embedding(10, 4, padding_idx=0)"),
        (nn.GELU(approximate="tanh"), "torch.nn.GELU(approximate='tanh')"),
        (nn.Linear(2, 2, dtype=torch.float64), "torch.nn.Linear(2, 2, dtype=torch.float64)"),
    ],
)
def test_torch_nn_layers_are_rebuilt_from_hyperparameters(module: nn.Module, expected: str) -> None:
    assert leaf_constructor("m", module, ImportTable()) == expected


def test_unreproducible_layer_names_the_module() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)
    with pytest.raises(
        CodegenError, match="'blocks.0'.*TransformerEncoderLayer.*d_model.*--frontend export"
    ):
        leaf_constructor("blocks.0", layer, ImportTable())


def test_every_configuration_value_is_kept() -> None:
    # MultiheadAttention's repr and parameters do not show batch_first or dropout
    mha = nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)
    assert (
        leaf_constructor("attn", mha, ImportTable())
        == "torch.nn.MultiheadAttention(32, 4, dropout=0.1, batch_first=True)"
    )
    mha_kv = nn.MultiheadAttention(8, 2, kdim=4, vdim=6)
    assert (
        leaf_constructor("attn", mha_kv, ImportTable())
        == "torch.nn.MultiheadAttention(8, 2, kdim=4, vdim=6)"
    )


def test_a_layer_that_rebuilds_differently_is_refused() -> None:
    mha = nn.MultiheadAttention(
        8, 2, bias=False
    )  # `bias` is not stored: the default rebuilds it with biases
    with pytest.raises(CodegenError, match="'attn'.*parameters or buffers differ"):
        leaf_constructor("attn", mha, ImportTable())
    norm = nn.LayerNorm(4)
    norm.register_forward_pre_hook(lambda m, args: (args[0] * 2,))
    with pytest.raises(CodegenError, match="'norm'.*hooks"):
        leaf_constructor("norm", norm, ImportTable())


def test_user_leaf_without_recorded_arguments_is_an_error() -> None:
    class Custom(nn.Module):
        pass

    with pytest.raises(
        CodegenError, match="'x'.*no\\s+constructor arguments|recorded no constructor"
    ):
        leaf_constructor("x", Custom(), ImportTable())


@dataclasses.dataclass
class Config:
    width: int
    ratio: float = 0.5


def test_literals() -> None:
    imports = ImportTable()
    assert (
        render_literal((1, [2.5, float("inf")], {"a": None}, True, torch.float16), imports)
        == "(1, [2.5, float(\"inf\")], {'a': None}, True, torch.float16)"
    )
    assert render_literal((3,), imports) == "(3,)"
    assert render_literal(Config(4), imports) == "Config(width=4, ratio=0.5)"
    assert ("test_leaves", "Config") in imports.names.values() or any(
        m.endswith("test_leaves") for m, _ in imports.names.values()
    )
    with pytest.raises(CodegenError, match="cannot write the constructor argument"):
        render_literal(object(), imports)


def test_attr_expr_uses_getattr_for_non_identifiers() -> None:
    assert attr_expr("self", "layers.0.fc") == 'getattr(self.layers, "0").fc'
    assert attr_expr("self", "training") == 'getattr(self, "training")'


@pytest.mark.parametrize(
    "value",
    [
        None,
        True,
        3,
        2.5,
        float("nan"),
        "s",
        b"b",
        torch.float16,
        torch.device("cpu"),
        (1, [2, {"a": 3}]),
        Config(4),
        object(),
        nn.Linear(2, 2),
        (1, object()),
        {"k": lambda: 0},
        torch.ones(2),
    ],
)
def test_the_tracer_knows_what_a_stage_can_write(value: object) -> None:
    # fxpipe.tracer.construct.rebuild.literal_problem decides at trace time what render_literal can write later
    from fxpipe.tracer.construct.rebuild import literal_problem

    try:
        render_literal(value, ImportTable())
        writable = True
    except CodegenError:
        writable = False
    assert (literal_problem(value) is None) == writable
