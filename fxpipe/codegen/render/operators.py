"""Write ``torch.ops.aten`` calls the way people write PyTorch: ``x + y``, ``x.view(...)``, ``F.linear(...)``.

Note [exact operator rewrites]: an exported graph records the aten overload that each
Python-level call dispatched to. ``rewrite_aten`` replaces a node only by a call that
dispatches to the SAME aten op with the same arguments, so values, aliasing and autograd
are those of the recorded op. Each rule below is one of:

- an operator or Tensor method whose binding is that op (``aten.add.Tensor`` is ``a + b``,
  ``aten.view.default`` is ``a.view(size)``, ``aten.slice.Tensor`` is ``a[:, s:e]``);
- the public ``torch.<name>`` / ``torch.nn.functional.<name>`` function, a thin binding of
  that op (``F.linear``, ``torch.softmax``, ``torch.cumsum``).

Three rules differ in an argument that does not change the result, and are tested as such:
``aten.layer_norm``'s ``cudnn_enable`` (ignored by ATen; ``F.layer_norm`` passes the
global cudnn flag), ``aten.to.dtype_layout`` with a strided layout (``Tensor.to`` goes
through ``aten.to.device``; both are the same ``to_impl``), and a full-range slice
(``a[:]`` returns an alias in eager mode). Every rule is checked in
``tests/codegen/test_operators.py`` against the aten op on random inputs: values,
gradients and the op that a pre-dispatch trace records. Anything else stays an aten call.
"""

from __future__ import annotations

import operator
import sys
from typing import Any, Callable

import torch
import torch.fx as fx
import torch.nn.functional as F

__all__ = ["rewrite_aten", "rewrite_call", "RULES"]

_aten = torch.ops.aten
_MAX = sys.maxsize  # export's "to the end" for slice ends
Call = tuple[str, Any, tuple, dict]  # (fx op, target, args, kwargs)
Rule = Callable[[tuple, dict], "Call | None"]

_INFIX: dict[str, Callable[..., Any]] = {
    "add.Tensor": operator.add,
    "sub.Tensor": operator.sub,
    "mul.Tensor": operator.mul,
    "div.Tensor": operator.truediv,
    "matmul.default": operator.matmul,
    "pow.Tensor_Scalar": operator.pow,
    "pow.Tensor_Tensor": operator.pow,
    "remainder.Tensor": operator.mod,
    "remainder.Scalar": operator.mod,
    "floor_divide.default": operator.floordiv,
    "eq.Tensor": operator.eq,
    "eq.Scalar": operator.eq,
    "ne.Tensor": operator.ne,
    "ne.Scalar": operator.ne,
    "lt.Tensor": operator.lt,
    "lt.Scalar": operator.lt,
    "le.Tensor": operator.le,
    "le.Scalar": operator.le,
    "gt.Tensor": operator.gt,
    "gt.Scalar": operator.gt,
    "ge.Tensor": operator.ge,
    "ge.Scalar": operator.ge,
    "__and__.Tensor": operator.and_,
    "__and__.Scalar": operator.and_,
    "__or__.Tensor": operator.or_,
    "__or__.Scalar": operator.or_,
    "__xor__.Tensor": operator.xor,
    "__xor__.Scalar": operator.xor,
}
_PREFIX: dict[str, Callable[..., Any]] = {
    "neg.default": operator.neg,
    "bitwise_not.default": operator.invert,
}
_METHODS: dict[str, str] = {
    "view.default": "view",
    "view.dtype": "view",
    "reshape.default": "reshape",
    "transpose.int": "transpose",
    "permute.default": "permute",
    "unsqueeze.default": "unsqueeze",
    "squeeze.dim": "squeeze",
    "squeeze.dims": "squeeze",
    "squeeze.default": "squeeze",
    "flatten.using_ints": "flatten",
    "split.Tensor": "split",
    "split_with_sizes.default": "split",
    "chunk.default": "chunk",
    "unbind.int": "unbind",
    "type_as.default": "type_as",
    "masked_fill.Scalar": "masked_fill",
    "masked_fill.Tensor": "masked_fill",
    "new_ones.default": "new_ones",
    "new_zeros.default": "new_zeros",
    "new_full.default": "new_full",
    "new_empty.default": "new_empty",
    "copy_.default": "copy_",
    "clone.default": "clone",
    "detach.default": "detach",
    "repeat.default": "repeat",
    "expand_as.default": "expand_as",
    "view_as.default": "view_as",
    "to.dtype": "to",
    "to.device": "to",
    "add_.Tensor": "add_",
    "mul_.Tensor": "mul_",
    "zero_.default": "zero_",
    "fill_.Scalar": "fill_",
    "masked_fill_.Scalar": "masked_fill_",
    "sym_size.int": "size",
    "sym_numel.default": "numel",
    "sym_stride.int": "stride",
    "item.default": "item",
}
_TORCH: tuple[str, ...] = (
    "tanh.default",
    "sigmoid.default",
    "exp.default",
    "log.default",
    "sqrt.default",
    "rsqrt.default",
    "abs.default",
    "sin.default",
    "cos.default",
    "erf.default",
    "relu.default",
    "cumsum.default",
    "diff.default",
    "addmm.default",
    "bmm.default",
    "mm.default",
    "baddbmm.default",
    "cat.default",
    "stack.default",
    "where.self",
    "softmax.int",
    "log_softmax.int",
    "arange.default",
    "arange.start",
    "arange.start_step",
    "full.default",
    "zeros.default",
    "ones.default",
    "zeros_like.default",
    "ones_like.default",
    "full_like.default",
    "gather.default",
    "index_select.default",
    "mean.dim",
    "mean.default",
    "sum.dim_IntList",
    "sum.default",
    "amax.default",
    "amin.default",
    "clamp.default",
    "tril.default",
    "triu.default",
    "maximum.default",
    "minimum.default",
    "logical_not.default",
    "logical_and.default",
    "logical_or.default",
    "flip.default",
    "roll.default",
    "argmax.default",
    "max.dim",
    "min.dim",
    "batch_norm.default",
    "group_norm.default",
    "conv1d.default",
    "conv2d.default",
    "max_pool2d.default",
    "isnan.default",
)
_FUNCTIONAL: tuple[str, ...] = (
    "linear.default",
    "dropout.default",
    "scaled_dot_product_attention.default",
    "gelu.default",
    "silu.default",
    "adaptive_avg_pool2d.default",
)
_FACTORY_DEFAULTS = {"pin_memory": (None, False), "layout": (None, torch.strided)}


def _key(op: torch._ops.OpOverload) -> str:
    return f"{op._opname}.{op._overloadname}"


def _tidy(kwargs: dict) -> dict:
    """Leave out factory keywords that only restate their defaults."""
    return {
        k: v
        for k, v in kwargs.items()
        if not (k in _FACTORY_DEFAULTS and v in _FACTORY_DEFAULTS[k])
    }


def _infix(fn: Callable[..., Any]) -> Rule:
    def rule(args: tuple, kwargs: dict) -> Call | None:
        if kwargs or len(args) != 2 or not isinstance(args[0], fx.Node):
            return None  # e.g. add's alpha=: torch.add, not `+`
        return "call_function", fn, args, {}

    return rule


def _prefix(fn: Callable[..., Any]) -> Rule:
    def rule(args: tuple, kwargs: dict) -> Call | None:
        return None if kwargs or len(args) != 1 else ("call_function", fn, args, {})

    return rule


def _method(name: str) -> Rule:
    def rule(args: tuple, kwargs: dict) -> Call | None:
        if not args or not isinstance(args[0], fx.Node):
            return None
        return "call_method", name, args, _tidy(kwargs)

    return rule


def _function(fn: Callable[..., Any]) -> Rule:
    def rule(args: tuple, kwargs: dict) -> Call | None:
        return "call_function", fn, args, _tidy(kwargs)

    return rule


def _rsub(args: tuple, kwargs: dict) -> Call | None:
    if kwargs or len(args) != 2 or isinstance(args[1], fx.Node):
        return None  # `s - x` is Tensor.__rsub__ -> aten.rsub.Scalar(x, s) when alpha is 1
    return "call_function", operator.sub, (args[1], args[0]), {}


def _expand(args: tuple, kwargs: dict) -> Call | None:
    return None if kwargs.get("implicit") else ("call_method", "expand", args, {})


def _contiguous(args: tuple, kwargs: dict) -> Call | None:
    fmt = kwargs.get("memory_format", torch.contiguous_format)
    return (
        ("call_method", "contiguous", args, {})
        if fmt == torch.contiguous_format and len(args) == 1
        else None
    )


def _to_dtype_layout(args: tuple, kwargs: dict) -> Call | None:
    """``x.to(device=d, dtype=t)``: the same ``to_impl`` as ``aten.to.dtype_layout`` for a strided layout."""
    rest = {k: v for k, v in kwargs.items() if k not in ("dtype", "device", "layout", "pin_memory")}
    if (
        kwargs.get("layout") not in (None, torch.strided)
        or kwargs.get("pin_memory")
        or any(rest.values())
    ):
        return None
    out = {k: kwargs[k] for k in ("device", "dtype") if kwargs.get(k) is not None}
    return "call_method", "to", args, out


def _layer_norm(args: tuple, kwargs: dict) -> Call | None:
    """``F.layer_norm`` without the ``cudnn_enable`` flag, which ATen ignores."""
    args = args[:5]
    return (
        "call_function",
        F.layer_norm,
        args,
        {k: v for k, v in kwargs.items() if k != "cudnn_enable"},
    )


def _embedding(args: tuple, kwargs: dict) -> Call | None:
    """``F.embedding(indices, weight, ...)``: torch.embedding(weight, indices, padding_idx, ...) underneath."""
    names = ("padding_idx", "scale_grad_by_freq", "sparse")
    extra = dict(zip(names, args[2:]), **kwargs)
    out: dict[str, Any] = {}
    if extra.get("padding_idx", -1) >= 0:
        out["padding_idx"] = extra["padding_idx"]
    elif extra.get("padding_idx", -1) != -1:
        return None
    for name in names[1:]:
        if extra.get(name):
            out[name] = True
    return "call_function", F.embedding, (args[1], args[0]), out


def _index_of(dim: int, rank: int | None, index: Any) -> tuple | None:
    if dim >= 0:
        return (slice(None),) * dim + (index,)
    if rank is not None:
        return (slice(None),) * (rank + dim) + (index,)
    return (Ellipsis, index) + (slice(None),) * (-dim - 1)


def _rank(node: Any) -> int | None:
    val = node.meta.get("val") if isinstance(node, fx.Node) else None
    return val.dim() if isinstance(val, torch.Tensor) else None


def _slice(args: tuple, kwargs: dict) -> Call | None:
    if kwargs or not isinstance(args[0], fx.Node):
        return None
    dim, start, end, step = (tuple(args[1:]) + (0, None, None, 1)[len(args) - 1 :])[:4]
    start = None if start == 0 else start
    end = None if end is not None and not isinstance(end, fx.Node) and end >= _MAX else end
    index = _index_of(dim, _rank(args[0]), slice(start, end, None if step == 1 else step))
    return None if index is None else ("call_function", operator.getitem, (args[0], index), {})


def _select(args: tuple, kwargs: dict) -> Call | None:
    if kwargs or len(args) != 3 or not isinstance(args[0], fx.Node):
        return None
    index = _index_of(args[1], _rank(args[0]), args[2])
    return None if index is None else ("call_function", operator.getitem, (args[0], index), {})


def _alias(args: tuple, kwargs: dict) -> Call | None:
    return (
        None
        if kwargs or len(args) != 1
        else ("call_function", operator.getitem, (args[0], Ellipsis), {})
    )


def _index(args: tuple, kwargs: dict) -> Call | None:
    """``x[i, j]`` for integer index tensors of rank >= 1 (a 0-d index would become a select)."""
    if kwargs or len(args) != 2 or not args[1]:
        return None
    for i in args[1]:
        val = i.meta.get("val") if isinstance(i, fx.Node) else None
        if (
            not isinstance(val, torch.Tensor)
            or val.dim() == 0
            or val.dtype not in (torch.int64, torch.int32)
        ):
            return None
    return "call_function", operator.getitem, (args[0], tuple(args[1])), {}


def _build_rules() -> dict[str, Rule]:
    rules: dict[str, Rule] = {k: _infix(f) for k, f in _INFIX.items()}
    rules.update({k: _prefix(f) for k, f in _PREFIX.items()})
    rules.update({k: _method(m) for k, m in _METHODS.items()})
    for key in _TORCH:
        rules[key] = _function(getattr(torch, key.split(".")[0]))
    for key in _FUNCTIONAL:
        rules[key] = _function(getattr(F, key.split(".")[0]))
    rules.update(
        {
            "rsub.Scalar": _rsub,
            "expand.default": _expand,
            "contiguous.default": _contiguous,
            "to.dtype_layout": _to_dtype_layout,
            "layer_norm.default": _layer_norm,
            "embedding.default": _embedding,
            "slice.Tensor": _slice,
            "select.int": _select,
            "alias.default": _alias,
            "index.Tensor": _index,
        }
    )
    return rules


RULES: dict[str, Rule] = _build_rules()


def rewrite_call(node: fx.Node) -> Call | None:
    """The exact Python spelling of an aten ``call_function`` node, or None to keep the aten call."""
    target = node.target
    if (
        node.op != "call_function"
        or not isinstance(target, torch._ops.OpOverload)
        or target.namespace != "aten"
    ):
        return None
    rule = RULES.get(_key(target))
    return None if rule is None else rule(tuple(node.args), dict(node.kwargs))


def rewrite_aten(graph: fx.Graph) -> None:
    """Replace, in place, every aten node that has an exact Python spelling (Note [exact operator rewrites])."""
    for node in list(graph.nodes):
        call = rewrite_call(node)
        if call is None:
            continue
        op, target, args, kwargs = call
        with graph.inserting_before(node):
            new = graph.create_node(op, target, args, kwargs)
        new.meta.update(node.meta)
        node.replace_all_uses_with(new)
        graph.erase_node(node)
