"""One generated class for the modules of a class that differ only in the sizes they were built with.

Note [classes that differ in their sizes]: Note [one class per distinct body] gives two bodies one
class only when their text is the same, so transformers' ``Conv1D(nf, nx)``, built at four sizes
in a GPT-2 block, came out as ``Conv1D``, ``Conv1D_2``, ``Conv1D_3`` and ``Conv1D_4``: the same
text but for the sizes in its parameters' shapes and in its ``view`` calls. Such a class takes the
sizes as its constructor did (``Conv1D(nf=96, nx=32)``), keeps them (``self.nx``) and reads them
where the traced text had the numbers. The sizes are the constructor's integer arguments that
the module keeps under their own name (``self.nx = nx``), that differ between the model's
modules of that class, and that are a dimension of a tensor the module itself holds. In a body,
a number equal to one of them is read from it where it sizes a tensor (the arguments of
``torch.empty`` in ``__init__``, a list or an index in ``forward``); a number equal to two of them
is read from the one the constructor takes first.

Exact by construction: a body is an instance of such a class only when the class's text, with
the body's own sizes written in, is the body's traced text, character for character; otherwise it
gets a class of its own, as before.
"""

from __future__ import annotations

import inspect
import io
import tokenize
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = ["SizedClass", "sizes_of", "template", "fill", "slotted", "declare"]

_SLOT = "\x00"


@dataclass(frozen=True)
class SizedClass:
    """A generated class that takes sizes: its name, the sizes in constructor order, its text with slots."""

    name: str
    params: tuple[str, ...]
    key: str


def sizes_of(model: nn.Module, path: str, own: Sequence[torch.Tensor]) -> dict[str, int]:
    """The sizes the module at ``path`` was built with that differ between the model's modules of its class
    and size one of its own tensors ``own``, in constructor order (Note [classes that differ in their sizes])."""
    module = model.get_submodule(path)
    cls = type(module)
    try:
        names = list(inspect.signature(cls.__init__).parameters)[1:]
    except (TypeError, ValueError):
        return {}
    dims = {d for t in own for d in t.shape}
    peers = [m for m in model.modules() if type(m) is cls]
    found: dict[str, int] = {}
    for name in names:
        value = _size(module, name)
        if value is None or value not in dims:
            continue
        if len({_size(m, name) for m in peers}) > 1:
            found[name] = value
    return found


def _size(module: nn.Module, name: str) -> int | None:
    value = module.__dict__.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def template(lines: Sequence[str], sizes: Mapping[str, int], *, init: bool) -> list[str]:
    """``lines`` with each number that sizes a tensor and equals one of ``sizes`` made a slot of that size's
    name (the first of equal sizes): in ``torch.empty(...)`` for ``init`` lines, in brackets otherwise."""
    by_value: dict[int, str] = {}
    for name, value in sizes.items():
        by_value.setdefault(value, name)
    return [_slots(line, by_value, init) for line in lines]


def _slots(line: str, by_value: Mapping[int, str], init: bool) -> str:
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(line.lstrip()).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return line
    indent = len(line) - len(line.lstrip())
    stack: list[str] = []  # "[" or "(" or "empty(" for each open bracket
    cuts: list[tuple[int, int, str]] = []
    previous: list[tokenize.TokenInfo] = []
    for tok in tokens:
        if tok.type == tokenize.OP and tok.string in "([":
            called = [t.string for t in previous[-3:]]
            stack.append("empty(" if called == ["torch", ".", "empty"] else tok.string)
        elif tok.type == tokenize.OP and tok.string in ")]" and stack:
            stack.pop()
        elif tok.type == tokenize.NUMBER and tok.string.isdigit() and int(tok.string) in by_value:
            negative = (
                len(previous) >= 1
                and previous[-1].string == "-"
                and (len(previous) < 2 or previous[-2].string in ("[", "(", ",", ":"))
            )
            sizing = "empty(" in stack if init else "[" in stack
            if sizing and not negative:
                cuts.append((tok.start[1], tok.end[1], by_value[int(tok.string)]))
        if tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.COMMENT):
            previous.append(tok)
    text = line.lstrip()
    for start, end, name in reversed(cuts):
        text = f"{text[:start]}{_SLOT}{name}{_SLOT}{text[end:]}"
    return " " * indent + text


def fill(lines: Sequence[str], values: Mapping[str, object]) -> list[str]:
    """``lines`` with each slot replaced by ``values[name]`` (a number, or how the class reads it)."""
    out = []
    for line in lines:
        parts = line.split(_SLOT)
        out.append(
            "".join(str(values[p]) if i % 2 else p for i, p in enumerate(parts))
            if len(parts) > 1
            else line
        )
    return out


def slotted(lines: Sequence[str]) -> list[str]:
    """The size names ``lines`` read, in order of first use."""
    names: dict[str, None] = {}
    for line in lines:
        for i, part in enumerate(line.split(_SLOT)):
            if i % 2:
                names.setdefault(part, None)
    return list(names)


def declare(params: Sequence[str]) -> tuple[str, list[str]]:
    """The ``__init__`` signature's parameters and the lines that keep them, for a class taking ``params``."""
    return ", ".join(f"{p}: int" for p in params), [f"self.{p} = {p}" for p in params]
