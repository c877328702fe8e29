"""What a generated ``forward`` frees (Note [frees that matter]) and what it calls its values (Note [names from the
source]): frees kept exactly where the modelled peak needs them, source names on the export path, names given back
once a value is dead, one result per module, no ``device`` argument."""

from __future__ import annotations

import operator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.fx as fx
import torch.nn as nn
from codegen_support import build_sources

from fxpipe.codegen import emit_build, load_pipeline
from fxpipe.codegen.render import frees
from fxpipe.codegen.render.forward import render_forward
from fxpipe.codegen.render.pyrender import ImportTable
from fxpipe.codegen.render.statements import assigned_names
from fxpipe.graphmeta import SPEC_KEY
from fxpipe.tracer import trace_model
from fxpipe.tracer.profile import TensorSpec


def _render(g: fx.Graph) -> tuple[str, Any]:
    imports = ImportTable()
    source = "\n".join(
        imports.lines() + render_forward(g, imports, lambda target: f"self.{target}")
    )
    namespace: dict[str, Any] = {}
    exec(compile(source, "<forward>", "exec"), namespace)  # noqa: S102 - our own rendered source
    return source, namespace["forward"]


def _big(node: fx.Node, n: int = 1000) -> fx.Node:
    node.meta[SPEC_KEY] = TensorSpec((n,))
    return node


def _graph() -> fx.Graph:
    """t1 = x + 1; t2 = t1 * 2; s = t2.sum(); v = t2.view(-1); t4 = x * 3; t5 = t4 * 2 -> (s, v, t5)."""
    g = fx.Graph()
    x = _big(g.placeholder("x"))
    t1 = _big(g.call_function(operator.add, (x, 1)), 4000)
    t2 = _big(g.call_function(operator.mul, (t1, 2)))
    s = g.call_method("sum", (t2,))
    s.meta[SPEC_KEY] = TensorSpec(())
    v = _big(g.call_method("view", (t2, -1)))
    t4 = _big(g.call_function(operator.mul, (x, 3)), 2000)
    t5 = _big(g.call_function(operator.mul, (t4, 2)))
    g.output((s, v, t5))
    return g


def test_only_frees_that_lower_the_peak_are_written() -> None:
    source, forward = _render(_graph())
    assert (
        "mul = add * 2;  add = None" in source
    )  # t1 (4000) dead before t4 (2000) is made: the peak needs it
    assert "x = None" not in source  # the caller holds its arguments
    assert (
        "view = mul.view(-1)\n" in source
    )  # t2 is still held by its view: freeing the name frees nothing
    assert "mul = x * 3\n" in source  # t2's name is free again: t4 takes it (as `x = f(x)` does)
    assert "mul = mul * 2\n" in source  # t4 dies on the last line: nothing is made after it
    data = torch.randn(1000)
    s, v, t5 = forward(None, data)
    assert (
        torch.equal(v, (data + 1) * 2)
        and torch.equal(t5, data * 3 * 2)
        and torch.equal(s, ((data + 1) * 2).sum())
    )


def _freed(source: str) -> set[str]:
    names: set[str] = set()
    for line in source.splitlines():
        free = line.split(";  ")[-1] if ";  " in line else line.strip()
        if free.endswith(" = None"):
            names.update(n.strip() for n in free[: -len(" = None")].split(" = "))
    return names


@pytest.mark.parametrize(
    "rule, freed", [("all", {"x", "add", "mul"}), ("needed", {"add"}), ("none", set())]
)
def test_the_benchmark_rules_write_every_free_or_none(
    monkeypatch: pytest.MonkeyPatch, rule: str, freed: set[str]
) -> None:
    monkeypatch.setattr(frees, "RULE", rule)
    source, _ = _render(_graph())
    assert _freed(source) == freed


@pytest.mark.parametrize(
    "line, names",
    [
        ("hidden_states = self.input_layernorm(hidden_states)", ["hidden_states"]),
        ("hidden_states, _ = self.self_attn(", ["hidden_states", "_"]),
        ("(q, k) = split(x)", ["q", "k"]),
        ("outputs: BaseModelOutputWithPast = self.model(", ["outputs"]),
        ("x += 1", ["x"]),
        ("return self.weight * hidden_states.to(input_dtype)", []),
        ("if a == b:", []),
        ("self.cache = x", []),
        ("mask[0] = 1", []),
        ("a <= b", []),
    ],
)
def test_assigned_names(line: str, names: list[str]) -> None:
    assert assigned_names(line) == names


class _Norm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(8))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + 1e-6)
        return self.weight * hidden_states.to(input_dtype)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = _Norm()
        self.proj = nn.Linear(8, 8)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.norm(hidden_states)
        scaled = self.proj(hidden_states) * torch.arange(8, device=hidden_states.device)
        hidden_states = residual + scaled
        return hidden_states


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Layer() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        logits = self.head(x)
        return logits


def test_export_path_names_values_as_the_source_does(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _Model()
    inputs = (torch.randn(2, 3, 8),)
    traced = trace_model(model, inputs, frontend="export", progress=False)
    assert traced.frontend == "export"
    stage_of = {
        n: (0 if i < len(traced.unit_of_node) // 2 else 1)
        for i, n in enumerate(traced.unit_of_node)
    }
    manifest = emit_build(
        traced.graph_module,
        traced.model,
        stage_of,
        2,
        tmp_path,
        source=None,
        microbatch=2,
        batch_size=2,
        microbatches=1,
        output_spec=traced.output_spec,
    )
    text = build_sources(tmp_path, manifest)
    assert (
        "def forward(self, hidden_states):\n        hidden_states = hidden_states.to(torch.float32)"
        in text
    )
    assert "variance = " in text and "scaled = " in text
    # the norm returns one value although the residual reads its input through an identity `to`
    assert "return self.weight * hidden_states" in text
    assert (
        "def forward(self, hidden_states, device)" not in text
        and "device = hidden_states.device" in text
    )
    assert manifest.stages[-1].outputs[-1].name == "logits"
    pipeline = load_pipeline(tmp_path)
    torch.testing.assert_close(pipeline(*inputs), model(*inputs))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """A helper function as transformers writes them (``apply_rotary_pos_emb``)."""
    first, second = x[..., :4], x[..., 4:]
    return x * cos + torch.cat([-second, first], -1) * sin


class _Rotating(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        angles = self.proj(x)
        cos, sin = angles.cos(), angles.sin()
        rotated = rotate(x, cos, sin)
        return self.proj(rotated)


def test_a_helper_function_is_written_once_and_called(tmp_path: Path) -> None:
    """Note [helper calls]: the helper's operators become a generated function called where the source calls it."""
    torch.manual_seed(0)
    model = nn.Sequential(_Rotating(), _Rotating())
    inputs = (torch.randn(2, 3, 8),)
    traced = trace_model(model, inputs, frontend="export", progress=False)
    stage_of = {n: 0 for n in traced.unit_of_node}
    manifest = emit_build(
        traced.graph_module,
        traced.model,
        stage_of,
        1,
        tmp_path,
        source=None,
        microbatch=2,
        batch_size=2,
        microbatches=1,
        output_spec=traced.output_spec,
    )
    text = build_sources(tmp_path, manifest)
    assert text.count("def rotate(x, cos, sin):") == 1, text  # one definition for both layers
    assert "rotated = rotate(x, cos, sin)" in text
    pipeline = load_pipeline(tmp_path)
    torch.testing.assert_close(pipeline(*inputs), model(*inputs))
