"""Train and eval mode in one graph: the ``training`` flag, mode guards, and running a graph in a mode.

Note [both modes in one graph]: a model computes different functions in train and in
eval mode (dropout, batch-norm statistics, stochastic depth, ``p if self.training else 0``).
The tracer traces both modes and merges them (:mod:`fxpipe.tracer.train_eval.merge`) into ONE
normalized graph that reads the mode where it matters:

- a ``get_attr`` node with target ``"training"`` (:data:`TRAINING_ATTR`) is the module's own
  ``self.training`` (``.train()`` / ``.eval()`` set it on every stage and generated class);
  it owns no tensor, so the splitter copies it into every stage that reads it;
- a value that differs between the modes is a ``train_or_eval(training, a, b)`` node
  (rendered ``a if self.training else b``);
- a node that runs in one mode only carries ``meta[GUARD_KEY]`` (``True``: train mode only,
  ``False``: eval mode only), rendered inside ``if self.training:`` / ``if not self.training:``.
  Its value is read only by nodes of the same guard and by ``train_or_eval`` nodes, and never
  crosses a stage boundary (:func:`guarded_regions` says what must stay together).

``torch.fx``'s own code generation ignores guards (it runs every node); :class:`ModeInterpreter`
honours them, and so does the code that fxpipe emits.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator

import torch
import torch.fx
import torch.nn as nn

from fxpipe.graphmeta import GUARD_KEY

__all__ = [
    "TRAINING_ATTR",
    "modes_restored",
    "train_or_eval",
    "is_training_flag",
    "guard_of",
    "ModeInterpreter",
    "run_in_mode",
    "guarded_regions",
    "is_random_op_name",
]

TRAINING_ATTR = "training"


def train_or_eval(training: bool, if_train: Any, if_eval: Any) -> Any:
    """``if_train`` in train mode, ``if_eval`` in eval mode: a value that differs between the modes."""
    return if_train if training else if_eval


def is_training_flag(node: Any) -> bool:
    """Whether ``node`` reads the module's ``training`` flag (see Note [both modes in one graph])."""
    return (
        isinstance(node, torch.fx.Node) and node.op == "get_attr" and node.target == TRAINING_ATTR
    )


def guard_of(node: torch.fx.Node) -> bool | None:
    """``True``: the node runs in train mode only; ``False``: eval mode only; ``None``: always."""
    guard = node.meta.get(GUARD_KEY)
    return None if guard is None else bool(guard)


@contextlib.contextmanager
def modes_restored(model: nn.Module) -> Iterator[None]:
    """Put every submodule back in the mode it had (``train()``/``eval()`` set all of them) after the block."""
    saved = [(m, m.training) for m in model.modules()]
    try:
        yield
    finally:
        for module, training in saved:
            module.training = training


class ModeInterpreter(torch.fx.Interpreter):
    """Runs a merged graph as the emitted code does in one mode: guarded nodes of the other mode are skipped."""

    def __init__(
        self, gm: torch.fx.GraphModule, training: bool, *, keep_values: bool = False
    ) -> None:
        super().__init__(gm, garbage_collect_values=not keep_values)
        self.training = training

    def run_node(self, n: torch.fx.Node) -> Any:
        guard = guard_of(n)
        if guard is not None and guard != self.training:
            return None
        if is_training_flag(n):
            return self.training
        return super().run_node(n)


def run_in_mode(
    gm: torch.fx.GraphModule, inputs: Iterable[Any], training: bool
) -> dict[torch.fx.Node, Any]:
    """Every node's value of one run of ``gm`` in the given mode (``None`` for nodes the mode skips)."""
    interp = ModeInterpreter(gm, training, keep_values=True)
    interp.run(*inputs)
    return interp.env


def guarded_regions(graph: torch.fx.Graph) -> list[set[torch.fx.Node]]:
    """Groups of nodes that must stay in one unit and one stage: each guarded node with its users,
    joined where they share a node (a guarded value exists in one mode only, so it cannot be sent)."""
    parent: dict[torch.fx.Node, torch.fx.Node] = {}

    def find(n: torch.fx.Node) -> torch.fx.Node:
        while parent.setdefault(n, n) is not n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for node in graph.nodes:
        if guard_of(node) is None:
            continue
        for user in node.users:
            if user.op != "output":
                parent[find(user)] = find(node)
        find(node)
    groups: dict[torch.fx.Node, set[torch.fx.Node]] = {}
    for node in parent:
        groups.setdefault(find(node), set()).add(node)
    return [g for g in groups.values() if len(g) > 1]


def is_random_op_name(name: str) -> bool:
    """Whether the aten op packet ``name`` (``"native_dropout"``, ``"bernoulli_"``) draws random numbers
    (``torch.Tag.nondeterministic_seeded``)."""
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return False
    try:
        overloads = packet.overloads()
    except Exception:  # noqa: BLE001 - not an op packet
        return False
    return any(torch.Tag.nondeterministic_seeded in getattr(packet, o).tags for o in overloads)
