"""Leaf module constructors and literal rendering."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn as nn

from fxpipe.codegen.leaves import leaf_constructor
from fxpipe.codegen.pyrender import ImportTable, attr_expr, render_literal
from fxpipe.errors import CodegenError


@pytest.mark.parametrize("module,expected", [
    (nn.Linear(4, 8, bias=False), "torch.nn.Linear(4, 8, bias=False)"),
    (nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), "torch.nn.Conv2d(3, 8, (3, 3), stride=(2, 2), padding=(1, 1), bias=False)"),
    (nn.BatchNorm1d(6, momentum=0.3, affine=False), "torch.nn.BatchNorm1d(6, momentum=0.3, affine=False)"),
    (nn.LayerNorm(5, eps=1e-6, bias=False), "torch.nn.LayerNorm((5,), eps=1e-06, bias=False)"),
    (nn.Embedding(10, 4, padding_idx=0), "torch.nn.Embedding(10, 4, padding_idx=0)"),
    (nn.GELU(approximate="tanh"), "torch.nn.GELU(approximate='tanh')"),
    (nn.Linear(2, 2, dtype=torch.float64), "torch.nn.Linear(2, 2, dtype=torch.float64)"),
])
def test_torch_nn_layers_are_rebuilt_from_hyperparameters(module: nn.Module, expected: str) -> None:
    assert leaf_constructor("m", module, ImportTable()) == expected


def test_unreproducible_layer_names_the_module() -> None:
    layer = nn.TransformerEncoderLayer(8, 2, dim_feedforward=16)
    with pytest.raises(CodegenError, match="'blocks.0'.*TransformerEncoderLayer"):
        leaf_constructor("blocks.0", layer, ImportTable())


def test_user_leaf_without_recorded_arguments_is_an_error() -> None:
    class Custom(nn.Module):
        pass

    with pytest.raises(CodegenError, match="'x'.*no\\s+constructor arguments|recorded no constructor"):
        leaf_constructor("x", Custom(), ImportTable())


@dataclasses.dataclass
class Config:
    width: int
    ratio: float = 0.5


def test_literals() -> None:
    imports = ImportTable()
    assert render_literal((1, [2.5, float("inf")], {"a": None}, True, torch.float16), imports) == \
        "(1, [2.5, float(\"inf\")], {'a': None}, True, torch.float16)"
    assert render_literal((3,), imports) == "(3,)"
    assert render_literal(Config(4), imports) == "Config(width=4, ratio=0.5)"
    assert ("test_leaves", "Config") in imports.names.values() or any(
        m.endswith("test_leaves") for m, _ in imports.names.values())
    with pytest.raises(CodegenError, match="cannot write the constructor argument"):
        render_literal(object(), imports)


def test_attr_expr_uses_getattr_for_non_identifiers() -> None:
    assert attr_expr("self", "layers.0.fc") == 'getattr(self.layers, "0").fc'
    assert attr_expr("self", "training") == 'getattr(self, "training")'
