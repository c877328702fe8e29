"""A line that calls a helper function is written as a call of a generated function of that name.

Note [helper calls]: torch.export records the operators of a helper function the source calls
(``create_causal_mask``, ``apply_rotary_pos_emb``, ``attention_interface``) inline, each with the
line of the forward that called it (Note [names from the source] in
:mod:`fxpipe.codegen.render.statements`); ``masking_utils.create_causal_mask`` alone is some 40 lines of
aranges, unsqueezes and index arithmetic. Such a run of operators is moved into a generated
function named after the helper and called where the run was, so the forward reads
``causal_mask = create_causal_mask(attention_mask, size)`` and the operators are written once, in
the function (one definition per distinct text, in ``shared.py`` when several stages call it).
Moving a contiguous run of nodes into a function that receives what they read and returns what is
read after them is exact whatever the nodes are (as Note [outlining module calls] argues). A run is
moved when:

- its line assigns the result of a call of a plain name (``x = helper(...)``: not a method, not
  ``self.``, not a builtin, not ``torch``/``F``), and every node of the line in this function is an
  operator made on that line (none inside a module call the line makes);
- it holds at least ``MIN_NODES`` operators, contiguous in the graph (size reads from outside the
  run may sit between them and are read first), none guarded for one mode or reading the module's
  ``training`` flag, and none with a side effect the run would reorder (there is none to reorder:
  the run stays where it was);
- a size it reads from outside is read inside from one of its tensor arguments when that argument
  has the dimension (export's shapes say so), and a device from its first tensor argument.
"""

from __future__ import annotations

import builtins
import operator
import re
from typing import Any

import torch
import torch.fx as fx

from fxpipe.codegen.render.forward import GeneratedFunction, base_name
from fxpipe.codegen.graph.outline import is_device, is_metadata, size_inputs, share_sizes
from fxpipe.codegen.render.statements import (
    SOURCE_NAME_KEY,
    STATEMENT_KEY,
    Statement,
    name_from_source,
    result_names,
    statement_of,
)
from fxpipe.graphmeta import ARITY_KEY, NAME_KEY, SPEC_KEY
from fxpipe.tracer.train_eval.modes import guard_of, is_training_flag

__all__ = ["GeneratedFunction", "outline_helper_calls", "MIN_NODES"]

MIN_NODES = 5
_CALL = re.compile(r"=\s*(?P<fn>[A-Za-z_]\w*)\s*\(")
_NOT_HELPERS = frozenset(dir(builtins)) | {
    "torch",
    "F",
    "nn",
    "math",
    "operator",
    "np",
    "functional",
    "self",
    "super",
    "cls",
}


def _helper(statement: Statement) -> str | None:
    m = _CALL.search(statement.frame.code)
    if m is None or m.start() != statement.frame.code.find("="):
        return None
    name = m["fn"]
    return None if name in _NOT_HELPERS or name.startswith("_") else name


def outline_helper_calls(graph: fx.Graph) -> list[GeneratedFunction]:
    """Replace, in place, every run of operators that a call of a helper function made by a call of a generated
    function (Note [helper calls]); return the functions, in the order they are called."""
    nodes = [n for n in graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    groups: dict[Statement, list[fx.Node]] = {}
    for node in nodes:
        statement = statement_of(node)
        if statement is not None:
            groups.setdefault(statement, []).append(node)
    made: list[GeneratedFunction] = []
    for statement, members in groups.items():
        name = _helper(statement)
        if name is None or len(members) < MIN_NODES:
            continue
        function = _outline(graph, statement, members, name)
        if function is not None:
            made.append(function)
    return made


def _eligible(node: fx.Node) -> bool:
    return (
        node.op in ("call_function", "call_method")
        and STATEMENT_KEY not in node.meta
        and guard_of(node) is None
        and not isinstance(node.target, GeneratedFunction)
        and not any(is_training_flag(a) for a in node.all_input_nodes)
    )


def _outline(
    graph: fx.Graph, statement: Statement, members: list[fx.Node], name: str
) -> GeneratedFunction | None:
    if not all(_eligible(m) for m in members):
        return None
    order = [n for n in graph.nodes if n.op not in ("placeholder", "get_attr", "output")]
    first, last = order.index(members[0]), order.index(members[-1])
    inside = set(members)
    between = [n for n in order[first : last + 1] if n not in inside]
    if any(not is_metadata(n) or any(a in inside for a in n.all_input_nodes) for n in between):
        return None
    for n in between:  # size reads that sit in the run: read before it (they read nothing of it)
        members[0].prepend(n)
    inputs: dict[fx.Node, None] = {}
    for m in members:
        for a in m.all_input_nodes:
            if a not in inside:
                inputs.setdefault(a, None)
    outputs = [m for m in members if any(u not in inside for u in m.users)]
    if not outputs or any(
        a.op == "get_attr" and not isinstance(a.meta.get("val"), torch.Tensor) for a in inputs
    ):
        return None
    sizes = size_inputs(list(inputs))
    written = _call_arguments(
        statement.frame.code, name
    )  # the order the line passes them in, where it says
    args = sorted(
        (a for a in inputs if a not in sizes), key=lambda a: written.get(_name(a), len(written))
    )
    devices = [a for a in args if is_device(a)]
    tensor = next((a for a in args if a not in devices and _is_tensor(a)), None)
    if tensor is not None:
        args = [a for a in args if a not in devices]
    else:
        devices = []
    body = fx.Graph()
    env: dict[fx.Node, Any] = {}
    for i, a in enumerate(args):
        ph = body.placeholder(f"arg{i}")
        ph.meta.update({k: v for k, v in a.meta.items() if k in ("val", SPEC_KEY)})
        ph.meta[NAME_KEY] = _name(a)
        env[a] = ph
    for a, (source, dim) in sizes.items():
        env[a] = body.call_method("size", (env[source], dim))
        env[a].meta.update({k: v for k, v in a.meta.items() if k in ("val", SPEC_KEY)})
        env[a].meta[NAME_KEY] = "size"
    for a in devices:
        assert tensor is not None  # devices is empty without one
        env[a] = body.call_function(getattr, (env[tensor], "device"))
        env[a].meta[NAME_KEY] = "device"
    for m in members:
        env[m] = body.node_copy(m, lambda x: env[x])
    body.output(env[outputs[0]] if len(outputs) == 1 else tuple(env[o] for o in outputs))
    used = share_sizes(body)
    args = [a for a in args if used[env[a]]]
    for ph in [n for n in body.nodes if n.op == "placeholder" and not used[n]]:
        body.erase_node(ph)
    body.lint()
    name_from_source(body)  # what the call's line calls its results
    function = GeneratedFunction(name, body)
    with graph.inserting_before(members[0]):
        call = graph.call_function(function, tuple(args))
    call.meta[STATEMENT_KEY] = statement
    call.meta[NAME_KEY] = name
    if len(outputs) == 1:
        call.meta.update({k: v for k, v in outputs[0].meta.items() if k in ("val", SPEC_KEY)})
        outputs[0].replace_all_uses_with(call, delete_user_cb=lambda u: u not in inside)
    else:
        call.meta[ARITY_KEY] = len(outputs)
        anchor = call
        for i, out in enumerate(outputs):
            with graph.inserting_after(anchor):
                item = graph.call_function(operator.getitem, (call, i))
            item.meta.update({k: v for k, v in out.meta.items() if k in ("val", SPEC_KEY)})
            item.meta[STATEMENT_KEY] = statement
            out.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)
            anchor = item
    given = [call] if len(outputs) == 1 else [n for n in call.users]
    for node, target in result_names(
        statement, given
    ).items():  # a later call's arguments take these names
        node.meta[NAME_KEY] = target
    for m in reversed(members):
        graph.erase_node(m)
    for a in list(inputs):
        if not a.users and a.op != "placeholder" and is_metadata(a):
            graph.erase_node(a)
    return function


def _name(node: fx.Node) -> str:
    return str(node.meta.get(NAME_KEY) or node.meta.get(SOURCE_NAME_KEY) or base_name(node.name))


def _call_arguments(code: str, name: str) -> dict[str, int]:
    """``{"query_states": 0, "key_states": 1, ...}`` for ``... = name(query_states, key_states, cos, sin)``."""
    start = code.find(name + "(")
    if start < 0:
        return {}
    text = code[start + len(name) + 1 :]
    names = [t.strip() for t in text.split(")")[0].split(",")]
    return {n: i for i, n in enumerate(names) if n.isidentifier()}


def _is_tensor(node: fx.Node) -> bool:
    from fxpipe.tracer.profile import TensorSpec

    return isinstance(node.meta.get("val"), torch.Tensor) or isinstance(
        node.meta.get(SPEC_KEY), TensorSpec
    )
