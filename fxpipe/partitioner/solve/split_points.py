"""``--split-at FQN``: stages that start at named modules, given to the solvers as pins.

Like ``torch.distributed.pipelining``'s ``SplitPoint.BEGINNING``, a split point is a
module path where a stage begins: its first unit in the topological order starts the
next stage. K split points make K + 1 stages, so they must match the stage count; the
units are then pinned by position (every unit before the first split point to stage 0,
and so on), which every solver honours (Note [stage cost]: pins are a constraint of the
problem, checked by ``assignment_violations``). Units keep any ``fxpipe.partition(i)``
pin they had, and a split point that contradicts one is an error.
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from dataclasses import replace

from fxpipe.errors import PinError
from fxpipe.partitioner.problem import PartitionProblem

__all__ = ["split_point_units", "pin_split_points"]


def _within(path: str, fqn: str) -> bool:
    return path == fqn or path.startswith(fqn + ".")


def _known_paths(problem: PartitionProblem) -> list[str]:
    """Every module path a split point may name: the units' paths and their ancestors."""
    out: set[str] = set()
    for path in problem.module_paths:
        parts = path.split(".") if path else []
        out.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return sorted(out)


def split_point_units(
    problem: PartitionProblem, split_at: Sequence[str], modules: Sequence[str] = ()
) -> list[int]:
    """The unit index each split point starts a stage at, in topological order. Raises ``PinError`` for a
    name that matches no unit (naming close matches, or, for a module of ``modules`` (the model's modules in
    the order they run) that shares a unit with what runs before it, the next module that starts one) and
    for two split points that start at one unit."""
    starts: dict[int, str] = {}
    for fqn in split_at:
        hit = next((i for i, path in enumerate(problem.module_paths) if _within(path, fqn)), None)
        if hit is None:
            hit = next((i for i, name in enumerate(problem.names) if name == fqn), None)
        if hit is None:
            inside = [i for i, m in enumerate(modules) if _within(m, fqn)]
            if inside:
                later = (
                    m
                    for m in modules[inside[-1] + 1 :]
                    if any(_within(p, m) for p in problem.module_paths)
                )
                nxt = next(later, None)
                raise PinError(
                    f"--split-at {fqn!r} names a module that shares a unit with what runs before it "
                    "(an in-place write to a tensor both use, a mode-guarded region or a module kept "
                    "whole holds them together), so no stage can start at it"
                    + (f"; split at the next module that starts a unit, {nxt!r}" if nxt else "")
                )
            close = difflib.get_close_matches(fqn, _known_paths(problem), n=3, cutoff=0.5)
            hint = (
                f"; did you mean {' or '.join(repr(c) for c in close)}?"
                if close
                else "; `fxpipe trace` lists the module paths"
            )
            raise PinError(f"--split-at {fqn!r} matches no unit's module path{hint}")
        if hit == 0:
            raise PinError(
                f"--split-at {fqn!r} starts at the model's first unit ({problem.names[0]!r}), so the "
                "stage before it would be empty; name a module after the first"
            )
        if hit in starts:
            raise PinError(
                f"--split-at {starts[hit]!r} and {fqn!r} both start at unit {problem.names[hit]!r}; "
                "a stage between them would be empty"
            )
        starts[hit] = fqn
    return sorted(starts)


def pin_split_points(
    problem: PartitionProblem, split_at: Sequence[str], modules: Sequence[str] = ()
) -> PartitionProblem:
    """``problem`` with every unit pinned to the stage the split points put it on (see the module docstring);
    ``modules``: the model's module paths in the order they run (``ModelProfile.module_order``), for messages."""
    if not split_at:
        return problem
    S = problem.num_stages
    if len(split_at) != S - 1:
        ranks = (
            f" ({problem.num_ranks} ranks x {problem.virtual_stages} virtual stages)"
            if problem.virtual_stages > 1
            else ""
        )
        raise PinError(
            f"{len(split_at)} --split-at point{'s' if len(split_at) != 1 else ''} make "
            f"{len(split_at) + 1} stages, but the plan has {S}{ranks}; give {S - 1} split points or "
            f"use --stages {len(split_at) + 1}" + (" --virtual-stages 1" if ranks else "")
        )
    starts = split_point_units(problem, split_at, modules)
    pins: list[int | None] = []
    stage = 0
    for u in range(problem.num_units):
        while stage < len(starts) and u >= starts[stage]:
            stage += 1
        old = problem.pins[u]
        if old is not None and old != stage:
            raise PinError(
                f"unit {problem.names[u]!r} is pinned to stage {old} (fxpipe.partition) but the "
                f"--split-at points put it on stage {stage}; drop one of them"
            )
        pins.append(stage)
    return replace(problem, pins=tuple(pins))
