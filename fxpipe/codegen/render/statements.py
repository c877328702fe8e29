"""The source statement each node of an exported graph comes from, and the names it gives values.

Note [names from the source]: torch.export records on each node the Python frames that made
it (``node.meta["stack_trace"]``): for a node made inside module calls M1 > ... > Mk, one
frame for the root's ``forward`` and one for each Mi's, outermost first, each with the line
it ran (a helper function such as ``apply_rotary_pos_emb`` leaves no frame of its own: its
nodes carry the line of the ``forward`` that called it). ``frames_of`` reads them, and only
when there is exactly one frame per module call, so a trace that says something else (or a
front end that records none, like symbolic tracing) names nothing.

The statement a node belongs to, in the function it is written in, is that function's frame:
the innermost one for an operator, and for the call of an outlined module the frame of the
module that calls it (``outline`` records it, ``STATEMENT_KEY``), together with the module
calls it ran in, so two layers' identical lines stay apart. A statement's *results* are its
nodes that something outside the statement reads. An assignment names its results:
``name = ...`` its result (``name_0``, ``name_1``, ... when it has several), ``a, b = ...`` its
results in order when there are as many as targets; a result of a ``return`` (or of any line
that names nothing) takes the name the enclosing statement gives it, the call's result. So ``query_states = self.q_proj(x).view(shape).transpose(1, 2)`` names the
``transpose``, and the ``view`` keeps its operator's name. An identity conversion with no name
of its own (Note [identity conversions] in :mod:`fxpipe.codegen.graph.aliases`) takes its input's.
Names only label code that is otherwise unchanged: a wrong guess costs readability, never
correctness.
"""

from __future__ import annotations

import keyword
import re
from dataclasses import dataclass

import torch.fx as fx

from fxpipe.codegen.graph.aliases import is_identity_conversion
from fxpipe.codegen.graph.scopes import scope_stack
from fxpipe.graphmeta import NAME_KEY

__all__ = [
    "Frame",
    "Statement",
    "FRAMES_KEY",
    "STATEMENT_KEY",
    "SOURCE_NAME_KEY",
    "record_frames",
    "frames_of",
    "statement_of",
    "statement_at",
    "assigned_names",
    "result_names",
    "source_names",
    "name_from_source",
]

FRAMES_KEY = "fxpipe_frames"  # node.meta: tuple[Frame, ...], the root's forward first
STATEMENT_KEY = "fxpipe_statement"  # node.meta: the Statement an outlined call is made in
SOURCE_NAME_KEY = "fxpipe_source_name"  # node.meta: its name in the stage's flat graph (outline names arguments so)

_COMPUTE = ("call_function", "call_method", "call_module")
_FILE_LINE = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>.+)$')
_ASSIGN = re.compile(
    r"^\(?\s*(?P<targets>\*?[A-Za-z_]\w*(?:\s*,\s*\*?[A-Za-z_]\w*)*)\s*,?\s*\)?\s*"
    r"(?::[^=]*)?(?:\*\*|//|>>|<<|[-+*/%@&|^])?=(?!=)"
)


@dataclass(frozen=True)
class Frame:
    """One frame of a node's stack trace: the file, line and source text it ran."""

    file: str
    line: int
    code: str


@dataclass(frozen=True)
class Statement:
    """One run of a source line: the module calls it ran in (their call keys) and its frame."""

    calls: tuple[str, ...]
    frame: Frame


def _parse(text: str) -> tuple[Frame, ...]:
    frames: list[Frame] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = _FILE_LINE.match(line)
        if m is None:
            continue
        code = (
            lines[i + 1].strip()
            if i + 1 < len(lines) and not _FILE_LINE.match(lines[i + 1])
            else ""
        )
        frames.append(Frame(m["file"], int(m["line"]), code))
    return tuple(frames)


def frames_of(node: fx.Node) -> tuple[Frame, ...] | None:
    """The node's frames, one per module call it was made in plus the root's (None when the trace has no such
    stack); see Note [names from the source]."""
    if FRAMES_KEY in node.meta:
        return node.meta[FRAMES_KEY]
    text = node.meta.get("stack_trace")
    if not isinstance(text, str) or not text:
        return None
    frames = _parse(text)
    return frames if frames and len(frames) == len(scope_stack(node)) + 1 else None


def record_frames(graph: fx.Graph) -> None:
    """Keep every node's frames under ``FRAMES_KEY`` (so its ``stack_trace`` may be dropped)."""
    for node in graph.nodes:
        if node.op in _COMPUTE and FRAMES_KEY not in node.meta:
            frames = frames_of(node)
            if frames is not None:
                node.meta[FRAMES_KEY] = frames


def statement_at(node: fx.Node, depth: int) -> Statement | None:
    """The statement that made ``node`` in the forward of the module ``depth`` calls deep (0: the root)."""
    frames = frames_of(node)
    stack = scope_stack(node)
    if frames is None or depth >= len(frames) or depth > len(stack):
        return None
    return Statement(tuple(key for key, _ in stack[:depth]), frames[depth])


def statement_of(node: fx.Node) -> Statement | None:
    """The statement ``node`` belongs to in the function it is written in (Note [names from the source])."""
    if STATEMENT_KEY in node.meta:
        return node.meta[STATEMENT_KEY]
    if node.op not in _COMPUTE:
        return None
    return statement_at(node, len(scope_stack(node)))


def assigned_names(code: str) -> list[str]:
    """The names a line of source assigns: ``["a"]`` for ``a = ...``, ``["a", "_"]`` for ``a, _ = f(``,
    ``[]`` for anything else (attribute or item targets, comparisons, ``return``, ...)."""
    m = _ASSIGN.match(code)
    if m is None:
        return []
    names = [t.strip().lstrip("*").strip() for t in m["targets"].split(",")]
    if any(keyword.iskeyword(n) for n in names):
        return []
    return names


def source_names(graph: fx.Graph, depth: int = 0) -> dict[fx.Node, str]:
    """``node -> name`` for the values the graph's source statements assign (Note [names from the source]).

    ``depth``: how many module calls deep the function the graph is written as runs (0: the root's
    forward); a node made deeper that no statement there names may take the name its value gets in
    an enclosing statement, down to that depth (what ``position_embeddings = self.rotary_emb(...)``
    assigns, where the rotary module's own ``return`` names nothing).
    """
    nodes = [n for n in graph.nodes if n.op in _COMPUTE]
    levels = {n: _levels(n, depth) for n in nodes}
    groups: dict[Statement, list[fx.Node]] = {}
    for node in nodes:
        for statement in levels[node]:
            groups.setdefault(statement, []).append(node)
    members = {st: set(ms) for st, ms in groups.items()}
    named: dict[Statement, dict[fx.Node, str]] = {}
    names: dict[fx.Node, str] = {}
    for node in nodes:
        for statement in levels[node]:  # innermost first
            if not any(u not in members[statement] for u in node.users):
                break  # a value inside the statement: what encloses it never sees it
            if statement not in named:
                named[statement] = _name_results(statement, groups[statement], members[statement])
            if node in named[statement]:
                names[node] = named[statement][node]
                break
    for node in nodes:
        if node not in names and is_identity_conversion(node) and node.args[0] in names:
            names[node] = names[node.args[0]]
    return names


def _levels(node: fx.Node, depth: int) -> list[Statement]:
    """The statements ``node`` is part of, from its own line out to the function ``depth`` calls deep."""
    if STATEMENT_KEY in node.meta:
        return [node.meta[STATEMENT_KEY]]
    out = []
    for d in range(len(scope_stack(node)), depth - 1, -1):
        statement = statement_at(node, d)
        if statement is None:
            break
        out.append(statement)
    return out


def result_names(statement: Statement, results: list[fx.Node]) -> dict[fx.Node, str]:
    """The names an assignment gives its results (the values it gives out, in order): ``name = ...`` its result
    (``name_0``, ``name_1``, ... when it has several), ``a, b = ...`` its results in order when there are as
    many as targets (or one result: the first target's; the others are no tensors, as in
    ``attn_output, attn_weights = ...`` whose weights are None)."""
    targets = assigned_names(statement.frame.code)
    if not targets or not results:
        return {}
    if len(targets) == 1:
        pairs = (
            [(results[0], targets[0])]
            if len(results) == 1
            else [(r, f"{targets[0]}_{i}") for i, r in enumerate(results)]
        )
    elif len(results) == len(targets):
        pairs = list(zip(results, targets))
    else:
        named = [t for t in targets if t != "_"]
        pairs = list(zip(results, named)) if len(named) == len(results) or len(results) == 1 else []
    return {node: target for node, target in pairs if target != "_" and not target.startswith("_")}


def _name_results(
    statement: Statement, members: list[fx.Node], inside: set[fx.Node]
) -> dict[fx.Node, str]:
    results = [m for m in members if any(u not in inside for u in m.users)]
    if (
        len(results) > 1
    ):  # a conversion that is its input itself is a result by aliasing, not by assignment
        results = [m for m in results if not is_identity_conversion(m)] or results
    return result_names(statement, results)


def name_from_source(graph: fx.Graph, depth: int = 0, key: str = NAME_KEY) -> None:
    """Set ``node.meta[key]`` (by default the preferred name, ``NAME_KEY``) of every value an assignment of the
    source names (``depth``: see ``source_names``)."""
    for node, name in source_names(graph, depth).items():
        node.meta[key] = name
