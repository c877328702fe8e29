"""An attention-mask helper the trace unrolled, written back as the few lines it stands for.

Note [short forms of mask helpers]: torch.export records transformers'
``masking_utils.create_causal_mask`` as some 30 operators of index arithmetic (aranges offset by
0, chains of ``unsqueeze``, an advanced-indexing lookup of the padding mask, ``new_ones & ...``)
that Note [helper calls] moves into one generated function. What they compute is short: a query
may attend a key that is not after it and not padding. A generated function whose body is
recognised as one of the forms below is written as that form's text instead of its operators.

A body is recognised only when it is shown to compute what the form computes:

- its operators are all index and mask arithmetic (``_ALLOWED``: aranges, sizes, unsqueezes,
  lookups, comparisons, ``&``, ``diff``/``cumsum``; no floating point, no randomness, nothing
  that reads a parameter), its arguments are what the form takes, in the same order;
- the body (run as traced) and the form's text (the very text written into the stage) give
  equal tensors, shapes and dtypes on probes: every length up to past the largest integer
  constant the body holds (so an offset or a window it applies shows) where a dimension is
  dynamic, the traced size where it is static, and masks all ones, all zeros, padded either
  side, random, and position ids counting up, restarting (packed sequences) and random.

A body that fails any check keeps its operators (correct, only longer). The zoo's dynamic-length
tests (``tests/zoo/test_zoo_dynamic.py``) compare the stages with the model at three lengths.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

__all__ = ["ShortForm", "short_form"]

_LENGTHS = (1, 2, 3, 5, 8, 13)
_BATCHES = (1, 2, 3)
_MAX_CONSTANT = 256  # a body with a larger integer constant is not probed past it: left as traced
_ALLOWED_FUNCTIONS = frozenset(
    {
        torch.arange,
        torch.diff,
        torch.cumsum,
        getattr,
        operator.getitem,
        operator.add,
        operator.sub,
        operator.le,
        operator.eq,
        operator.ne,
        operator.and_,
    }
)
_ALLOWED_METHODS = frozenset(
    {"size", "to", "bool", "unsqueeze", "new_ones", "expand", "view", "reshape", "contiguous"}
)


@dataclass(frozen=True)
class ShortForm:
    """A recognised helper: ``key`` (one per form: every body of the form is the same function) and
    ``lines(name)``, the function's source."""

    key: str
    params: tuple[str, ...]
    body: tuple[str, ...]

    def lines(self, name: str) -> list[str]:
        return [f"def {name}({', '.join(self.params)}):", *("    " + ln for ln in self.body)]

    def compiled(self) -> Any:
        scope: dict[str, Any] = {"torch": torch}
        exec(compile("\n".join(self.lines("f")), f"<{self.key}>", "exec"), scope)  # noqa: S102 - our text
        return scope["f"]


_FORMS = (
    ShortForm(
        "causal padding mask",
        ("attention_mask",),
        (
            '"""(batch, 1, query, key): True where the key is not after the query and not padding."""',
            "positions = torch.arange(attention_mask.size(1), device=attention_mask.device)",
            "causal = positions[None, :] <= positions[:, None]",
            "return causal & attention_mask.bool()[:, None, None, :]",
        ),
    ),
    ShortForm(
        "causal packed-sequence mask",
        ("position_ids", "batch"),
        (
            '"""(batch, 1, query, key): True where the key is not after the query in the same packed sequence',
            'of position_ids (a new one starts where they do not count up by 1)."""',
            "positions = position_ids.expand(batch, -1)",
            "starts = torch.diff(positions, prepend=positions[:, :1] - 1) != 1",
            "sequence = torch.cumsum(starts, -1)",
            "same = sequence[:, None, :, None] == sequence[:, None, None, :]",
            "return same & (positions[:, None, None, :] <= positions[:, None, :, None])",
        ),
    ),
)


def short_form(graph: fx.Graph) -> ShortForm | None:
    """The form the generated function ``graph`` computes (Note [short forms of mask helpers]), else None."""
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    if not _index_arithmetic(graph):
        return None
    largest = max(_int_constants(graph), default=0)
    if largest > _MAX_CONSTANT:
        return None
    for form in _FORMS:
        if len(form.params) != len(placeholders):
            continue
        probes = list(_probes(placeholders, largest))
        if probes and _agrees(graph, form.compiled(), probes):
            return form
    return None


def _index_arithmetic(graph: fx.Graph) -> bool:
    for node in graph.nodes:
        if node.op in ("placeholder", "output"):
            continue
        if node.op == "call_method" and node.target in _ALLOWED_METHODS:
            continue
        if (
            node.op == "call_function"
            and node.target in _ALLOWED_FUNCTIONS
            and (node.target is not getattr or node.args[1:] == ("device",))
        ):
            continue
        return False
    out = next(n for n in graph.nodes if n.op == "output")
    value = out.args[0].meta.get("val") if isinstance(out.args[0], fx.Node) else None
    return isinstance(value, torch.Tensor) and value.dtype == torch.bool


def _int_constants(graph: fx.Graph) -> Iterator[int]:
    def walk(a: Any) -> Iterator[int]:
        if isinstance(a, bool):
            return
        if isinstance(a, int):
            yield abs(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                yield from walk(x)
        elif isinstance(a, slice):
            yield from walk((a.start, a.stop, a.step))
        elif isinstance(a, dict):
            yield from walk(tuple(a.values()))

    for node in graph.nodes:
        yield from walk((node.args, node.kwargs))


def _sizes(dim: Any, lengths: Sequence[int]) -> Sequence[int]:
    return (dim,) if isinstance(dim, int) else lengths


def _probes(placeholders: list[fx.Node], largest: int) -> Iterator[list[Any]]:
    """Argument lists to run a body and a form on: every size of every dynamic dimension, varied values."""
    lengths = sorted(set(_LENGTHS) | {largest + 2})
    choices: list[list[Any]] = []
    for ph in placeholders:
        val = ph.meta.get("val")
        if isinstance(val, torch.Tensor):
            if val.dim() != 2 or val.dtype.is_floating_point or val.dtype.is_complex:
                return
            shapes = itertools.product(
                _sizes(val.shape[0], _BATCHES), _sizes(val.shape[1], lengths)
            )
            choices.append([t for b, s in shapes for t in _tensors(b, s, val.dtype)])
        elif isinstance(val, (int, torch.SymInt)) and not isinstance(val, bool):
            choices.append(list(_sizes(val, _BATCHES)))
        else:
            return
    for args in itertools.product(*choices):
        yield list(args)


def _tensors(batch: int, length: int, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    g = torch.Generator().manual_seed(batch * 1000 + length)
    ones = torch.ones(batch, length, dtype=torch.long)
    padded = ones.clone()
    padded[-1, length - length // 3 :] = 0  # right padding
    padded[0, : length // 2] = 0  # left padding
    masks = [ones, torch.zeros_like(ones), padded]
    masks += [torch.randint(0, 2, (batch, length), generator=g) for _ in range(3)]
    if dtype == torch.bool:
        yield from (m.bool() for m in masks)
        return
    yield from (m.to(dtype) for m in masks)
    count = torch.arange(length).expand(batch, -1)
    restart = torch.arange(length) % 3  # three-token packed sequences
    yield from (p.to(dtype) for p in (count, count + 4, restart.expand(batch, -1)))
    yield torch.randint(0, length + 2, (batch, length), generator=g).to(dtype)


def _agrees(graph: fx.Graph, short: Any, probes: list[list[Any]]) -> bool:
    body = fx.Graph()
    body.output(body.graph_copy(graph, {}))
    traced = fx.GraphModule(torch.nn.Module(), body)
    ran = 0
    for args in probes:
        try:
            want = traced.forward(*args)
        except Exception:  # noqa: BLE001 - a static body outside its size: nothing to compare
            continue
        try:
            got = short(*args)
        except Exception:  # noqa: BLE001
            return False
        if not (
            isinstance(want, torch.Tensor)
            and isinstance(got, torch.Tensor)
            and got.shape == want.shape
            and got.dtype == want.dtype
            and torch.equal(got, want)
        ):
            return False
        ran += 1
    return ran > 0
