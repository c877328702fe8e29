"""``Solution``: what a solver returns, an assignment plus how much it proves about it."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Solution"]


@dataclass(frozen=True)
class Solution:
    """Stage of every unit (``assignment[u]``) found by ``solver``.

    ``optimal`` is True when the solver proved no assignment has a smaller bottleneck
    (under its own cost model, see each solver); ``bound_ms`` is the best lower bound it
    proved on the bottleneck, if any; ``status`` is a short human-readable note.
    """

    assignment: tuple[int, ...]
    solver: str
    optimal: bool = False
    bound_ms: float | None = None
    seconds: float = 0.0
    status: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "assignment", tuple(int(s) for s in self.assignment))
