"""``UnitRunner``: one profile unit's nodes as a standalone module, run on its recorded inputs.

Each unit runs on its own, with the values it received in the shape-propagation run as
(detached) inputs. The unit's nodes are compiled into ONE ``GraphModule`` call (not run
node by node through an ``Interpreter``, whose per-node Python cost inflated tiny units
several-fold when timed).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.fx
import torch.nn as nn

from fxpipe.tracer.units import UnitGroup

__all__ = ["UnitRunner", "nbytes"]


def nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (tuple, list)):
        return sum(nbytes(v) for v in value)
    return 0


class UnitRunner:
    """Runs one unit's nodes on its recorded inputs; ``forward()`` returns (outputs, grad leaves)."""

    def __init__(self, gm: torch.fx.GraphModule, group: UnitGroup, values: dict[torch.fx.Node, Any]) -> None:
        by_name = {n.name: n for n in gm.graph.nodes}
        self.gm = gm
        self.group = group
        self.attr_nodes = [by_name[a] for a in group.get_attrs]
        self.nodes = [by_name[n] for n in group.nodes]
        self.output_nodes = [by_name[n] for n in group.outputs]
        self.input_values = {by_name[n]: values[by_name[n]] for n in group.inputs}
        self.tensors = self._tensors()
        self._values = values  # every node's recorded value, to rerun an input's producer (Note [saved once])

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
        """The unit's nodes as one GraphModule: inputs in ``input_values`` order, a tuple of outputs."""
        graph = torch.fx.Graph()
        env: dict[torch.fx.Node, torch.fx.Node] = {}
        for node in self.input_values:
            env[node] = graph.placeholder(node.name)
        for node in self.attr_nodes + self.nodes:
            env[node] = graph.node_copy(node, lambda n: env[n])
        graph.output(tuple(env[n] for n in self.output_nodes))
        return torch.fx.GraphModule(self.gm, graph)

    def fresh_inputs(self) -> tuple[list[Any], list[torch.Tensor]]:
        """Detached copies of the recorded inputs (floating ones require grad), and the grad leaves."""
        leaves, args = [], []
        for value in self.input_values.values():
            if isinstance(value, torch.Tensor):
                value = value.detach().requires_grad_(value.requires_grad and value.is_floating_point())
                if value.requires_grad:
                    leaves.append(value)
            args.append(value)
        return args, leaves + self.params

    def forward(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        args, leaves = self.fresh_inputs()
        return list(self.module(*args)), leaves

    @staticmethod
    def backward(outputs: list[Any], leaves: list[torch.Tensor],
                 grad_outputs: list[torch.Tensor] | None = None) -> bool:
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
