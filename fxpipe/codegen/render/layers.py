"""``torch.nn`` layers recognised in a traced module call, so a stage can call the layer itself.

Export flattens ``self.ln_1(x)`` into one ``F.layer_norm(x, [32], w, b, 1e-05)`` node. When a
call of a ``torch.nn`` layer is exactly that layer's ``forward`` (the one operator it
runs, on its own parameters, with its own hyperparameters), the stage builds the layer
and calls it. Only layers whose ``forward`` does not depend on ``training`` are listed
(``Dropout`` and ``BatchNorm`` bake the mode in at export time, so their traced body is
kept). The layer must also be one a stage can rebuild equal to the original in its whole
configuration (Note [rebuilt modules equal the original] in :mod:`fxpipe.tracer.construct.rebuild`): a
call can match while an attribute the traced body does not show differs (an instance
``forward`` put in place, a hook). ``tests/codegen/test_layers.py`` exports each listed layer
and checks that its graph matches here.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.tracer.construct.rebuild import rebuild_problem

__all__ = ["TORCH_LAYERS", "torch_layer_input"]

Matcher = Callable[[fx.Node, Any, Callable[[str], Any]], Any]


def _linear(node: fx.Node, m: Any, w: Callable[[str], Any]) -> Any:
    rest = tuple(node.args[1:])
    if m.bias is None:
        ok = rest in ((w("weight"),), (w("weight"), None))
    else:
        ok = rest == (w("weight"), w("bias"))
    return node.args[0] if ok and node.target is F.linear and not node.kwargs else None


def _layer_norm(node: fx.Node, m: Any, w: Callable[[str], Any]) -> Any:
    if node.target is not F.layer_norm or node.kwargs or len(node.args) < 2:
        return None
    args: tuple[Any, ...] = tuple(node.args) + (None, None, 1e-5)[len(node.args) - 2 :]
    shape = args[1]
    want = (
        list(m.normalized_shape),
        w("weight") if m.weight is not None else None,
        w("bias") if m.bias is not None else None,
        m.eps,
    )
    ok = isinstance(shape, (list, tuple)) and (list(shape), *args[2:5]) == want
    return node.args[0] if ok else None


def _embedding(node: fx.Node, m: Any, w: Callable[[str], Any]) -> Any:
    kwargs = {
        k: v
        for k, v in [
            ("padding_idx", m.padding_idx),
            ("scale_grad_by_freq", m.scale_grad_by_freq or None),
            ("sparse", m.sparse or None),
        ]
        if v is not None
    }
    ok = (
        node.target is F.embedding
        and m.max_norm is None
        and tuple(node.args[1:]) == (w("weight"),)
        and dict(node.kwargs) == kwargs
    )
    return node.args[0] if ok else None


def _conv(fn: Any) -> Matcher:
    def match(node: fx.Node, m: Any, w: Callable[[str], Any]) -> Any:
        if (
            node.target is not fn
            or node.kwargs
            or m.padding_mode != "zeros"
            or isinstance(m.padding, str)
        ):
            return None
        n = len(m.kernel_size)
        defaults = (None, [1] * n, [0] * n, [1] * n, 1)
        if len(node.args) < 2:
            return None
        args = (
            tuple(node.args[2:]) + defaults[len(node.args) - 2 :]
        )  # bias, stride, padding, dilation, groups
        want = (
            w("weight"),
            w("bias") if m.bias is not None else None,
            list(m.stride),
            list(m.padding),
            list(m.dilation),
            m.groups,
        )
        got = (
            node.args[1],
            args[0],
            _ints(args[1], n),
            _ints(args[2], n),
            _ints(args[3], n),
            args[4],
        )
        return node.args[0] if got == want else None

    return match


def _ints(value: Any, n: int) -> Any:
    return [value] * n if isinstance(value, int) else list(value)


def _unary(fn: Any, **expected: Any) -> Matcher:
    """A layer whose forward is ``fn(x)`` when its attributes have the ``expected`` values."""

    def match(node: fx.Node, m: Any, w: Callable[[str], Any]) -> Any:
        ok = (
            node.target is fn
            and len(node.args) == 1
            and not node.kwargs
            and all(getattr(m, k) == v for k, v in expected.items())
        )
        return node.args[0] if ok else None

    return match


def _gelu(node: fx.Node, m: Any, w: Callable[[str], Any]) -> Any:
    want = {} if m.approximate == "none" else {"approximate": m.approximate}
    ok = node.target is F.gelu and len(node.args) == 1 and dict(node.kwargs) == want
    return node.args[0] if ok else None


TORCH_LAYERS: dict[type, Matcher] = {
    nn.Linear: _linear,
    nn.LayerNorm: _layer_norm,
    nn.Embedding: _embedding,
    nn.Conv1d: _conv(F.conv1d),
    nn.Conv2d: _conv(F.conv2d),
    nn.GELU: _gelu,
    nn.ReLU: _unary(torch.relu, inplace=False),
    nn.Tanh: _unary(torch.tanh),
    nn.Sigmoid: _unary(torch.sigmoid),
    nn.SiLU: _unary(F.silu, inplace=False),
}


def torch_layer_input(
    members: list[fx.Node], module: nn.Module, path: str, attrs: set[fx.Node]
) -> Any:
    """The input ``x`` when the call is exactly ``module(x)`` of a layer in ``TORCH_LAYERS``, else None."""
    match = TORCH_LAYERS.get(type(module))
    if match is None or len(members) != 1 or rebuild_problem(module) is not None:
        return None
    by_key = {str(a.target): a for a in attrs}
    own = [f"{path}.{k}" for k, _ in list(module.named_parameters()) + list(module.named_buffers())]
    if sorted(own) != sorted(by_key):
        return None
    x = match(members[0], module, lambda name: by_key.get(f"{path}.{name}"))
    return x if isinstance(x, fx.Node) else None
