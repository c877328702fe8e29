"""``UnitRunner``: one profile unit's nodes as a standalone module, run on its recorded inputs.

Each unit runs on its own, on fresh copies of the values it received in the
shape-propagation run (Note [fresh unit inputs]). The unit's nodes are compiled into ONE
``GraphModule`` call (not run node by node through an ``Interpreter``, whose per-node
Python cost inflated tiny units several-fold when timed).

Note [fresh unit inputs]: a unit may change its inputs in place (``nn.ReLU(inplace=True)``,
``out += identity``, export's ``add_``), and other units read the same recorded values.
So each run gets, per tensor input, a grad leaf that shares the recorded storage
(``value.detach()``, only ever read) and, as the argument, ``leaf.clone()``: a non-leaf
(in-place ops on a leaf that requires grad are refused) in storage of its own (recorded
values never change). Gradients are taken for the leaves; the clone's backward dispatches
no op. Copies are made by :meth:`UnitRunner.fresh_inputs`, which callers run OUTSIDE their
counting modes and timers, then :meth:`UnitRunner.run` is what they count. Note [saved
once] in :mod:`fxpipe.tracer.measure.counting` maps saved storages to input nodes through the
arguments' storages (:meth:`UnitInputs.node_of_storage`), not the recorded values'.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from fxpipe.tracer.measure.meta import storage_key
from fxpipe.tracer.train_eval.modes import guard_of
from fxpipe.tracer.units import UnitGroup

__all__ = ["UnitRunner", "UnitInputs", "fresh_copies", "nbytes"]


def nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    return 0


@dataclass(frozen=True)
class UnitInputs:
    """Fresh arguments for one run of a unit (Note [fresh unit inputs]).

    ``args``: one per input, tensors copied; ``leaves``: what gradients are taken for (the
    inputs' grad leaves, then the unit's parameters); ``nodes``: the input node of each argument.
    """

    args: tuple[Any, ...]
    leaves: tuple[torch.Tensor, ...]
    nodes: tuple[torch.fx.Node, ...]

    def node_of_storage(self) -> dict[int, torch.fx.Node]:
        """Data pointer of each tensor argument's storage -> the input node it stands for."""
        return {
            storage_key(a): node
            for node, a in zip(self.nodes, self.args)
            if isinstance(a, torch.Tensor)
        }


def fresh_copies(
    values: list[Any], requires_grad: list[bool]
) -> tuple[list[Any], list[torch.Tensor]]:
    """Arguments that stand for recorded ``values`` without ever changing them, and their grad leaves:
    a tensor whose ``requires_grad`` entry is true (and is floating) becomes ``leaf.clone()`` of a
    leaf sharing its storage, any other tensor a plain clone (Note [fresh unit inputs])."""
    args: list[Any] = []
    leaves: list[torch.Tensor] = []
    for value, grad in zip(values, requires_grad):
        if isinstance(value, torch.Tensor):
            if grad and value.is_floating_point():
                leaf = value.detach().requires_grad_(True)
                leaves.append(leaf)
                value = leaf.clone()
            else:
                value = value.detach().clone()
        args.append(value)
    return args, leaves


class UnitRunner:
    """Runs one unit's nodes on its recorded inputs; ``forward()`` returns (outputs, grad leaves)."""

    def __init__(
        self, gm: torch.fx.GraphModule, group: UnitGroup, values: dict[torch.fx.Node, Any]
    ) -> None:
        by_name = {n.name: n for n in gm.graph.nodes}
        self.gm = gm
        self.group = group
        self.attr_nodes = [by_name[a] for a in group.get_attrs]
        self.nodes = [by_name[n] for n in group.nodes]
        self.output_nodes = [by_name[n] for n in group.outputs]
        self.input_values = {by_name[n]: values[by_name[n]] for n in group.inputs}
        self.tensors = self._tensors()
        self._values = (
            values  # every node's recorded value, to rerun an input's producer (Note [saved once])
        )

    def _tensors(self) -> list[torch.Tensor]:
        """Parameters and buffers the unit reads (from get_attr nodes and leaf modules)."""
        found: dict[int, torch.Tensor] = {}
        for node in self.attr_nodes:
            value = _fetch(self.gm, str(node.target))
            if isinstance(value, torch.Tensor):
                found[id(value)] = value
        for node in self.nodes:
            if node.op == "call_module":
                module = self.gm.get_submodule(str(node.target))
                for t in list(module.parameters()) + list(module.buffers()):
                    found[id(t)] = t
        return list(found.values())

    @property
    def params(self) -> list[torch.Tensor]:
        return [t for t in self.tensors if isinstance(t, nn.Parameter) and t.requires_grad]

    @functools.cached_property
    def module(self) -> torch.fx.GraphModule:
        """The unit's nodes as one GraphModule: inputs in ``input_values`` order, a tuple of outputs;
        nodes that run in eval mode only are left out (``None``)."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self.input_values:
            env[node] = graph.placeholder(node.name)
        for node in self.attr_nodes + self.nodes:
            if guard_of(node) is False:  # the profile is of train mode, as the emitted code runs
                env[node] = None  # type: ignore[assignment]  # Note [eval-only nodes in shape propagation]
                continue
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in self.output_nodes))
        return torch.fx.GraphModule(self.gm, graph)

    def fresh_inputs(self) -> UnitInputs:
        """Copies of the recorded inputs to run the unit on; make them outside any counting mode or
        timer (Note [fresh unit inputs]). Inputs that required grad when recorded get grad leaves."""
        values = list(self.input_values.values())
        grads = [isinstance(v, torch.Tensor) and v.requires_grad for v in values]
        args, leaves = fresh_copies(values, grads)
        return UnitInputs(tuple(args), tuple(leaves) + tuple(self.params), tuple(self.input_values))

    def run(self, inputs: UnitInputs) -> list[Any]:
        """The unit's outputs on ``inputs`` (from :meth:`fresh_inputs`; use each only once)."""
        return list(self.module(*inputs.args))

    def forward(self) -> tuple[list[Any], list[torch.Tensor]]:
        """Fresh inputs and one run: (outputs, grad leaves)."""
        inputs = self.fresh_inputs()
        return self.run(inputs), list(inputs.leaves)

    @staticmethod
    def backward(
        outputs: list[Any],
        leaves: list[torch.Tensor] | tuple[torch.Tensor, ...],
        grad_outputs: list[torch.Tensor] | None = None,
    ) -> bool:
        """Backpropagate ``grad_outputs`` (default ones) from the differentiable outputs;
        False when there is nothing to do."""
        outs = [o for o in outputs if isinstance(o, torch.Tensor) and o.requires_grad]
        if not outs or not leaves:
            return False
        grads = grad_outputs if grad_outputs is not None else [torch.ones_like(o) for o in outs]
        torch.autograd.grad(outs, leaves, grad_outputs=grads, allow_unused=True)
        return True


def _fetch(gm: torch.fx.GraphModule, target: str) -> Any:
    owner, _, name = target.rpartition(".")
    return getattr(gm.get_submodule(owner) if owner else gm, name)
