"""Checks on tensor values in ``forward`` that only raise: kept as runtime asserts, not a reason to stop.

Note [checks on data]: a model may check its data in Python, ``if labels.max() >= vocab_size:
raise ValueError(...)`` (transformers' CTC heads). ``torch.export`` cannot branch on a value it
does not know and stops (``GuardOnDataDependentSymNode``). A branch whose body only raises (or an
``assert``) does not change what the model computes when it passes, so :func:`export_with_checks`
decides each ``bool()`` of data met inside such a check the way the check passes (False for the
test of ``if ...: raise``, True under a ``not`` or in an ``assert``), and defers that decision to a
runtime assert (``ShapeEnv.guard_or_defer_runtime_assert``, as ``torch._check`` does) (``aten._assert_scalar``) in the graph, which the stage that holds the data runs on every
microbatch. Any other branch on data (one that computes something either way) is refused with
its file, line and code: specialising it to the example would be a different model.
"""

from __future__ import annotations

import ast
import contextlib
import linecache
import logging
import sys
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Iterator, TypeVar

import torch

__all__ = ["DataCheck", "export_with_checks", "user_site", "caller_site", "is_data_dependent"]

T = TypeVar("T")
_SKIPPED = (
    str(Path(torch.__file__).resolve().parent),
    str(Path(__file__).resolve().parents[2]),  # fxpipe itself
    str(Path(contextlib.__file__).resolve().parent),  # the standard library
)


@dataclass(frozen=True)
class DataCheck:
    """Where a check on tensor values is: ``file:line`` and its first line of code; ``raises_only``:
    an ``if`` whose body only raises, or an ``assert``."""

    filename: str
    line: int
    code: str
    raises_only: bool
    asserted: tuple[
        str, ...
    ] = ()  # the conditions deferred to runtime asserts, as torch prints them

    def __str__(self) -> str:
        return f"{Path(self.filename).name}:{self.line} (`{self.code}`)"


def is_data_dependent(exc: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(exc, GuardOnDataDependentSymNode)


def _user(filename: str) -> bool:
    return not filename.startswith(_SKIPPED) and not filename.startswith("<")


def user_site(tb: TracebackType | None) -> tuple[str, int] | None:
    """The innermost frame of the user's (or a library model's) code in a traceback."""
    found = None
    while tb is not None:
        if _user(tb.tb_frame.f_code.co_filename):
            found = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        tb = tb.tb_next
    return found


def caller_site() -> tuple[str, int] | None:
    frame = sys._getframe(1)
    while frame is not None and not _user(frame.f_code.co_filename):
        frame = frame.f_back  # type: ignore[assignment]
    return None if frame is None else (frame.f_code.co_filename, frame.f_lineno)


def check_at(filename: str, line: int) -> DataCheck:
    """The statement at ``filename:line`` judged (Note [checks on data])."""
    code = linecache.getline(filename, line).strip()
    try:
        tree = ast.parse("".join(linecache.getlines(filename)))
    except (SyntaxError, ValueError):
        return DataCheck(filename, line, code, False)
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and node.lineno <= line <= (node.end_lineno or line):
            return DataCheck(filename, line, code, True)
        if isinstance(node, (ast.If, ast.While)) and node.test.lineno <= line <= (
            node.test.end_lineno or line
        ):
            raises = (
                isinstance(node, ast.If)
                and not node.orelse
                and all(isinstance(s, ast.Raise) for s in node.body)
            )
            return DataCheck(filename, node.lineno, code, raises)
    return DataCheck(filename, line, code, False)


def _needed(filename: str, line: int) -> bool | None:
    """The truth value a ``bool()`` of data at ``filename:line`` must have for the model not to raise:
    False in the test of an ``if`` that only raises (True under a ``not``), True in an ``assert``;
    None when the statement is no such check (Note [checks on data])."""
    check = check_at(filename, line)
    if not check.raises_only:
        return None
    tree = ast.parse("".join(linecache.getlines(filename)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert) and node.lineno <= line <= (node.end_lineno or line):
            return not isinstance(node.test, ast.UnaryOp)
        if isinstance(node, ast.If) and node.test.lineno <= line <= (node.test.end_lineno or line):
            return isinstance(node.test, ast.UnaryOp) and isinstance(node.test.op, ast.Not)
    return None


@contextlib.contextmanager
def _deciding(found: list[DataCheck]) -> Iterator[None]:
    """Export with each data-dependent ``bool()`` inside a check that only raises decided as the
    check passes, and that decision deferred to a runtime assert (Note [checks on data])."""
    import sympy  # type: ignore[import-untyped]
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode, ShapeEnv

    original = ShapeEnv.evaluate_expr

    def evaluate(self: Any, orig_expr: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return original(self, orig_expr, *args, **kwargs)
        except GuardOnDataDependentSymNode as exc:
            site = caller_site()
            if site is None or orig_expr.is_number:
                raise
            needed = _needed(*site)
            if needed is None:  # not a RuntimeError: torch would print its partial graph
                raise DataBranch(check_at(*site)) from exc
            check = orig_expr if needed else sympy.Not(orig_expr)
            known = next((i for i, c in enumerate(found) if (c.filename, c.line) == site), None)
            if known is None:
                found.append(check_at(*site))
                known = len(found) - 1
            found[known] = replace(found[known], asserted=(*found[known].asserted, str(check)))
            self.guard_or_defer_runtime_assert(
                check, f"fxpipe: the model's check at {Path(site[0]).name}:{site[1]} failed"
            )
            return sympy.true if needed else sympy.false

    ShapeEnv.evaluate_expr = evaluate  # type: ignore[method-assign]
    # torch logs each data-dependent stop with the partial graph (pages of text); the stop is ours
    # to report, in one line (Note [checks on data]), or decided here
    log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        ShapeEnv.evaluate_expr = original  # type: ignore[method-assign]
        log.setLevel(level)


class DataBranch(Exception):
    """``torch.export`` met a branch on tensor values that does more than raise (its site in ``check``)."""

    def __init__(self, check: DataCheck) -> None:
        super().__init__(
            f"a Python branch on a tensor's value at {check.filename}:{check.line} (`{check.code}`) "
            "changes what the model computes, so no trace can hold both sides"
        )
        self.check = check


def export_with_checks(export: Callable[[], T]) -> tuple[T, tuple[DataCheck, ...]]:
    """``export()`` with every check on data that only raises kept as a runtime assert (Note
    [checks on data]); a :class:`DataBranch` names any other branch on data. Returns the result
    and the checks kept."""
    found: list[DataCheck] = []
    try:
        with _deciding(found):
            result = export()
    except Exception as exc:
        site = user_site(exc.__traceback__) if is_data_dependent(exc) else None
        if site is None:
            raise
        raise DataBranch(check_at(*site)) from exc
    if found:
        graph = getattr(result, "graph_module", None)
        if graph is not None:
            _reword_asserts(graph.graph, found)
        warnings.warn(
            "fxpipe: kept "
            + ", ".join(str(c) for c in found)
            + " as runtime asserts: a check on the data that only raises runs in the stage that "
            "holds the data, on every microbatch",
            stacklevel=3,
        )
    return result, tuple(found)


def _reword_asserts(graph: torch.fx.Graph, checks: list[DataCheck]) -> None:
    """Give each runtime assert of a model's check the check's own site and code as its message
    (torch writes ``Runtime assertion failed for expression Ne(u0, 1) on node 'sym_not'``)."""
    for node in graph.nodes:
        if node.target is not torch.ops.aten._assert_scalar.default or len(node.args) < 2:
            continue
        message = str(node.args[1])
        for check in checks:
            if any(f"for expression {cond} on node" in message for cond in check.asserted):
                node.args = (
                    node.args[0],
                    f"the model's check at {check} failed on this microbatch (its forward raises there)",
                )
