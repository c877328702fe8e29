"""Models that fix their batch size: which line did it, and a trace static at the microbatch size.

Note [a batch the model fixes]: ``torch.export`` keeps the batch dimension symbolic, and stops with
``Constraints violated (batch)!`` when the model's code turns it into a constant: CLIP's contrastive
loss builds its targets with ``torch.arange(len(logits))`` (a B x B matrix). torch's message does
not say where.
:func:`recording` watches torch's ``ShapeEnv`` replace an input's size by a constant and keeps the
line of the model's code that did it; :func:`fixed_batch` then names it. Such a model cannot have a
dynamic batch, so the tracer traces it again with every size static, at the microbatch size it
was given, and says so in one line. That loses nothing the runtime needs: it feeds microbatches of
one size (the last one is never uneven: ``check_divisible``), and a build records the fixed size
(``Manifest.static_batch``: the line), so a step whose microbatches have another size is refused
before anything runs, naming the batch that works.
"""

from __future__ import annotations

import contextlib
import linecache
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

__all__ = ["Specialisation", "recording", "fixed_batch", "batch_was_fixed"]


@dataclass(frozen=True)
class Specialisation:
    """An input size made a constant (``value``) by the model's code at ``filename:line``."""

    value: int
    filename: str
    line: int

    def __str__(self) -> str:
        code = linecache.getline(self.filename, self.line).strip()
        return f"{Path(self.filename).name}:{self.line}" + (f" (`{code}`)" if code else "")


@contextlib.contextmanager
def recording(found: list[Specialisation]) -> Iterator[None]:
    """Record every replacement of an input's size symbol by a constant, with the model's line."""
    import sympy  # type: ignore[import-untyped]
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fxpipe.tracer.frontend.data_checks import caller_site

    original = ShapeEnv._set_replacement

    def replace(self: Any, a: Any, tgt: Any, msg: str) -> None:
        if isinstance(tgt, sympy.Integer) and self.var_to_sources.get(a):
            site = caller_site()
            if site is not None:
                found.append(Specialisation(int(tgt), *site))
        original(self, a, tgt, msg)

    ShapeEnv._set_replacement = replace  # type: ignore[method-assign]
    try:
        yield
    finally:
        ShapeEnv._set_replacement = original  # type: ignore[method-assign]


def batch_was_fixed(exc: BaseException) -> bool:
    """Whether ``exc`` is torch.export's refusal of a batch dimension the model made a constant."""
    return "Constraints violated (batch)" in str(exc)


def fixed_batch(found: list[Specialisation], batch: int) -> Specialisation | None:
    """The first line that made a size equal to the batch a constant (None: torch said nowhere)."""
    return next((s for s in found if s.value == batch), None)
