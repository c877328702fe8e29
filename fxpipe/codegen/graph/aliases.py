"""Which values of a stage graph share a tensor storage, and two clean-ups that follow from it.

Note [identity conversions]: ``x.to(torch.float32)`` on a float32 ``x`` returns ``x`` itself,
so a tracer that maps tensor objects to graph values sees every later use of ``x`` as a use
of the conversion. torch.export records ``hidden_states.to(torch.float32)`` inside an
RMSNorm, and the decoder layer's residual ``residual + hidden_states`` then reads that
``to``: the RMSNorm call returns two values (``(to, mul_1)``) where the source returns one.
Both are the same object while the dtypes are the traced ones (export asserts as much with
``aten._assert_tensor_metadata`` before each ``to``), so a use of such a conversion outside
the module call that made it may read its input instead; it then also reads what the source
reads when the dtypes differ. A conversion that is the only value its call gives out is left
alone (the call may return it).

Those asserts guard the graph's recorded aliasing for export's own passes (functionalization
re-traces the graph); an emitted stage is run eagerly, where ``Tensor.to`` decides for itself
whether to copy, so ``drop_metadata_asserts`` leaves them out (they checked only that a
tensor's dtype and device are the traced ones; a build runs at those, the manifest says so).
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx
from torch.multiprocessing.reductions import StorageWeakRef

from fxpipe.codegen.graph.scopes import scope_stack

__all__ = [
    "drop_metadata_asserts",
    "drop_unused_pure",
    "is_identity_conversion",
    "reroute_identity_conversions",
    "storage_of",
    "VIEW_METHODS",
]

_ASSERTS = (torch.ops.aten._assert_tensor_metadata.default,)
_TO = ("to", "type_as", "float", "double", "half", "bfloat16", "int", "long", "bool", "contiguous")
VIEW_METHODS = frozenset(
    {
        "view",
        "view_as",
        "transpose",
        "permute",
        "unsqueeze",
        "squeeze",
        "expand",
        "expand_as",
        "t",
        "narrow",
        "select",
        "split",
        "chunk",
        "unbind",
        "detach",
        "unflatten",
        "movedim",
        "swapaxes",
        "diagonal",
        "as_strided",
        "unfold",
    }
)


def drop_metadata_asserts(graph: fx.Graph) -> None:
    """Erase export's ``aten._assert_tensor_metadata`` checks (Note [identity conversions])."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target in _ASSERTS and not node.users:
            graph.erase_node(node)


_PURE_METHODS = VIEW_METHODS | {
    "size",
    "dim",
    "numel",
    "stride",
    "new_ones",
    "new_zeros",
    "new_full",
    "new_empty",
    "to",
    "type_as",
    "contiguous",
    "clone",
    "reshape",
    "flatten",
}
_PURE_FUNCTIONS = (
    operator.getitem,
    getattr,
    operator.add,
    operator.sub,
    operator.mul,
    operator.truediv,
    operator.floordiv,
    operator.neg,
    operator.eq,
    operator.ne,
    operator.lt,
    operator.le,
    operator.gt,
    operator.ge,
    operator.and_,
    operator.or_,
    torch.arange,
    torch.zeros,
    torch.ones,
    torch.full,
    torch.empty,
)


def drop_unused_pure(graph: fx.Graph) -> None:
    """Erase views, sizes, factories and arithmetic whose value nothing reads: computing them has no effect
    (a trace keeps, e.g., ``head_arange[None, :, None, None]`` of a mask that never uses it)."""
    for node in reversed(list(graph.nodes)):
        if node.users:
            continue
        pure = (node.op == "call_method" and node.target in _PURE_METHODS) or (
            node.op == "call_function" and node.target in _PURE_FUNCTIONS
        )
        if pure:
            graph.erase_node(node)


def storage_of(node: Any) -> StorageWeakRef | None:
    """The storage of a node's traced value (export records one per tensor; views share it), or of a tensor."""
    val = node.meta.get("val") if isinstance(node, fx.Node) else node
    if not isinstance(val, torch.Tensor):
        return None
    try:
        return StorageWeakRef(val.untyped_storage())
    except (RuntimeError, NotImplementedError):  # e.g. a sparse or nested traced value
        return None


def is_identity_conversion(node: fx.Node) -> bool:
    """``x.to(...)`` (or a ``to`` aten op) whose traced value is ``x`` itself: same storage, dtype and shape."""
    if not node.args or not isinstance(node.args[0], fx.Node):
        return False
    if node.op == "call_method":
        if node.target not in _TO:
            return False
    elif not (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target._opname in ("to", "_to_copy", "contiguous")
    ):
        return False
    source, val, src_val = node.args[0], node.meta.get("val"), node.args[0].meta.get("val")
    if not isinstance(val, torch.Tensor) or not isinstance(src_val, torch.Tensor):
        return False
    same = storage_of(node) is not None and storage_of(node) == storage_of(source)
    return (
        same
        and val.dtype == src_val.dtype
        and val.shape == src_val.shape
        and val.stride() == src_val.stride()
    )


def reroute_identity_conversions(graph: fx.Graph) -> None:
    """Uses of an identity conversion outside the module call that made it read its input
    (Note [identity conversions])."""
    nodes = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    for node in nodes:
        stack = scope_stack(node)
        if not stack or not is_identity_conversion(node):
            continue
        scope = stack[-1]
        outside = [u for u in node.users if scope not in scope_stack(u)]
        if not outside or not _gives_out_more(scope, node, nodes):
            continue
        source = node.args[0]
        for user in outside:
            user.replace_input_with(node, source)


def _gives_out_more(scope: tuple[str, str], node: fx.Node, nodes: list[fx.Node]) -> bool:
    """Whether the call ``scope`` gives out a value other than ``node`` (then ``node`` is not what it returns)."""
    for other in nodes:
        if other is node or scope not in scope_stack(other):
            continue
        if any(scope not in scope_stack(u) for u in other.users):  # the output node has no scope
            return True
    return False
