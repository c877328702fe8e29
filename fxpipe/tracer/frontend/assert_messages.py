"""``torch._assert`` messages as the user wrote them, not with ``Proxy(getitem_2)`` in their text.

Symbolic tracing runs ``torch._assert(h == self.image_size, f"... got {h}!")`` with ``h`` a
Proxy, so the message is frozen as ``"... got Proxy(getitem_2)!"``. :func:`note_assert_site`
records, when such a node is created, the line of the user's code that made it;
:func:`restore_assert_messages` then writes each traced value back as the expression the user
formatted (``"Wrong image height! Expected 32 but got {h}!"``; values that were constants at
trace time stay as they were formatted) or, when the source cannot be matched, as ``?``.
"""

from __future__ import annotations

import ast
import linecache
import operator
import re
import sys
import textwrap
from pathlib import Path

import torch
import torch.fx

__all__ = ["note_assert_site", "restore_assert_messages"]

SITE_KEY = "fxpipe_assert_site"  # node.meta: (filename, line) of the user's torch._assert call
_PROXY_REPR = re.compile(r"Proxy\(\w+\)")
_SKIPPED = (
    str(Path(torch.__file__).resolve().parent),
    str(Path(__file__).resolve().parents[1]),
)  # torch, the tracer
_MAX_STATEMENT_LINES = 20


def note_assert_site(node: torch.fx.Node) -> None:
    """Remember where a ``torch._assert`` node with a traced value in its message was called from."""
    if node.op != "call_function" or node.target is not torch._assert or len(node.args) < 2:
        return
    if not isinstance(node.args[1], str) or not _PROXY_REPR.search(node.args[1]):
        return
    frame = sys._getframe(1)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIPPED):
        frame = frame.f_back  # type: ignore[assignment]
    if frame is not None:
        node.meta[SITE_KEY] = (frame.f_code.co_filename, frame.f_lineno)


def restore_assert_messages(graph: torch.fx.Graph) -> None:
    """Rewrite every assert message that shows a Proxy (module docstring)."""
    by_name = {n.name: n for n in graph.nodes}
    shown: list[torch.fx.Node] = []
    for node in graph.nodes:
        site = node.meta.pop(SITE_KEY, None)
        if site is None:
            continue
        message = str(node.args[1])
        shown += [by_name[m[6:-1]] for m in _PROXY_REPR.findall(message) if m[6:-1] in by_name]
        node.args = (
            node.args[0],
            _as_written(message, *site) or _PROXY_REPR.sub("?", message),
            *node.args[2:],
        )
    for value in reversed(
        list(dict.fromkeys(shown))
    ):  # `x.shape` computed only for the message: now dead
        while (
            value.op == "call_function"
            and value.target in (getattr, operator.getitem)
            and not value.users
            and not value._erased
        ):
            inputs = value.all_input_nodes
            graph.erase_node(value)
            if len(inputs) != 1:
                break
            value = inputs[0]


def _as_written(message: str, filename: str, lineno: int) -> str | None:
    """The message with each Proxy replaced by ``{<source expression>}``, or None when the f-string at
    ``filename:lineno`` cannot be matched against it."""
    call = _statement_call(filename, lineno)
    if call is None:
        return None
    source, fstring = call
    pattern, expressions = "", []
    for part in fstring.values:
        if isinstance(part, ast.Constant):
            pattern += re.escape(str(part.value))
        elif isinstance(part, ast.FormattedValue):
            pattern += "(.*?)"
            expressions.append(ast.get_source_segment(source, part.value) or "?")
    match = re.fullmatch(pattern, message, re.DOTALL)
    if match is None:
        return None
    out, end = "", 0
    for i, expression in enumerate(expressions, start=1):
        out += message[end : match.start(i)]
        value = match.group(i)
        out += f"{{{expression}}}" if _PROXY_REPR.fullmatch(value) else value
        end = match.end(i)
    return out + message[end:]


def _statement_call(filename: str, lineno: int) -> tuple[str, ast.JoinedStr] | None:
    """The source of the statement at ``filename:lineno`` and the f-string its ``_assert(...)`` call formats."""
    lines = linecache.getlines(filename)
    for count in range(1, _MAX_STATEMENT_LINES + 1):
        source = textwrap.dedent("".join(lines[lineno - 1 : lineno - 1 + count]))
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for call in ast.walk(tree):
            if (
                isinstance(call, ast.Call)
                and len(call.args) >= 2
                and isinstance(call.args[1], ast.JoinedStr)
            ):
                return source, call.args[1]
        return None
    return None
