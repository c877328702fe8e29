"""Bring a front end's graph into the normalized form that codegen consumes.

Both front ends end here: module paths go into ``node.meta[PATH_KEY]``, the output
becomes a flat tuple of tensors (with a ``TreeSpec`` that rebuilds the model's own
structure), and each ``getitem`` sits right after the node it indexes so that
grouping consecutive nodes never splits a tuple from its consumer.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
import torch.fx
import torch.utils._pytree as pytree

from fxpipe.errors import TraceError
from fxpipe.graphmeta import PATH_KEY

__all__ = [
    "run_collect",
    "annotate_paths",
    "flatten_output",
    "group_getitems",
    "drop_extra_placeholders",
]

_IGNORED_STACK_KEY = "_empty_nn_module_stack_from_metadata_hook"
_CALL_SUFFIX = re.compile(r"@\d+$")


class _Collect(torch.fx.Interpreter):
    def __init__(self, gm: torch.fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)


def run_collect(gm: torch.fx.GraphModule, inputs: tuple[Any, ...]) -> dict[torch.fx.Node, Any]:
    """Run ``gm`` on ``inputs`` and return every node's value."""
    interp = _Collect(gm)
    interp.run(*inputs)
    return interp.env


def _stack_path(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    for key, value in reversed(list(stack.items())):
        if key == _IGNORED_STACK_KEY:
            continue
        path = value[0] if isinstance(value, tuple) else str(value)
        return _CALL_SUFFIX.sub("", path)
    return ""


def annotate_paths(gm: torch.fx.GraphModule) -> None:
    """Set ``meta[PATH_KEY]`` on every node: the innermost module whose forward made it."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            path = str(node.target)
        elif node.op == "get_attr":
            path = str(node.target).rpartition(".")[0]
        elif node.op in ("placeholder", "output"):
            path = ""
        else:
            path = _stack_path(node)
        node.meta[PATH_KEY] = path


def drop_extra_placeholders(gm: torch.fx.GraphModule, n_inputs: int) -> None:
    """Check that the graph's inputs are the traced call's ``n_inputs`` tensor inputs, dropping unused
    extra placeholders. The front ends make constants and used defaults part of the graph (Note [the
    traced call] in ``fxpipe.tracer.call``), so an extra placeholder that the graph uses is fxpipe's bug."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for node in placeholders[n_inputs:]:
        if node.users:
            raise TraceError(
                f"the traced graph reads the forward argument {node.target!r}, which is not one of "
                f"the call's {n_inputs} tensor inputs; please report this with the model"
            )
        gm.graph.erase_node(node)
    gm.recompile()


def _index_node(graph: torch.fx.Graph, node: torch.fx.Node, key: Any) -> torch.fx.Node:
    if isinstance(key, pytree.SequenceKey):
        return graph.call_function(operator.getitem, (node, key.idx))
    if isinstance(key, pytree.MappingKey):
        return graph.call_function(operator.getitem, (node, key.key))
    if isinstance(key, pytree.GetAttrKey):
        return graph.call_function(getattr, (node, key.name))
    raise TraceError(
        f"cannot index a model output with {key!r}; return tensors, tuples, dicts or ModelOutputs"
    )


def flatten_output(gm: torch.fx.GraphModule, values: dict[torch.fx.Node, Any]) -> pytree.TreeSpec:
    """Make the output node return a flat tuple of tensor nodes; return the spec to rebuild it.

    ``values`` are the node values of one run (:func:`run_collect`). Where an output
    is a node holding a container (a leaf module returning a tuple, a ModelOutput), the
    needed ``getitem``/``getattr`` nodes are inserted right after it.
    """
    graph = gm.graph
    out_node = next(n for n in graph.nodes if n.op == "output")
    out_arg = out_node.args[0]
    out_value = torch.fx.node.map_arg(out_arg, lambda n: values[n])
    flat_with_paths, spec = pytree.tree_flatten_with_path(out_value)
    flat_nodes: list[torch.fx.Node] = []
    for key_path, leaf in flat_with_paths:
        if not isinstance(leaf, torch.Tensor):
            raise TraceError(
                f"model output at {pytree.keystr(key_path)} is a {type(leaf).__name__}, expected a tensor; "
                "return only tensors (in tuples, dicts or ModelOutputs) from forward"
            )
        current: Any = out_arg
        for i, key in enumerate(key_path):
            if isinstance(current, torch.fx.Node):
                value = values[current]
                for rest in key_path[i:]:
                    with graph.inserting_after(current):
                        new = _index_node(graph, current, rest)
                    new.meta[PATH_KEY] = current.meta.get(PATH_KEY, "")
                    value = rest.get(value)
                    values[new] = value
                    current = new
                break
            current = key.get(current)
        if not isinstance(current, torch.fx.Node):
            raise TraceError(
                f"model output at {pytree.keystr(key_path)} is a constant, not computed by forward"
            )
        flat_nodes.append(current)
    out_node.args = (tuple(flat_nodes),)
    graph.lint()
    gm.recompile()
    return spec


def group_getitems(gm: torch.fx.GraphModule) -> None:
    """Move every ``getitem``/``getattr`` on a node's value to directly after that node."""
    graph = gm.graph
    for node in list(graph.nodes):
        indexers = [
            u
            for u in node.users
            if u.op == "call_function"
            and u.target in (operator.getitem, getattr)
            and u.args[0] is node
            and all(n is node for n in u.all_input_nodes)
        ]
        anchor = node
        for user in sorted(indexers, key=_position(graph)):
            anchor.append(user)
            anchor = user
    graph.lint()
    gm.recompile()


def _position(graph: torch.fx.Graph) -> Any:
    order = {n: i for i, n in enumerate(graph.nodes)}
    return lambda n: order[n]
