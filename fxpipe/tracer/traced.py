"""``TracedModel``: the in-memory result of tracing, handed from the tracer to codegen.

Note [normalized graph]: both front ends hand codegen the same form: one
placeholder per tensor input of the traced call (in the forward's parameter order; Note
[the traced call] in ``fxpipe.tracer.call``), ``get_attr`` nodes under ORIGINAL parameter and
buffer names, ``call_module`` only for leaves, one ``output`` node returning a flat tuple
of tensors, and on every node ``meta[SPEC_KEY]`` (``TensorSpec``/``None``/tuple) and
``meta[PATH_KEY]`` (owning module path, ``""`` = top level). Where train and eval mode differ,
a ``get_attr`` of ``"training"`` and ``meta[GUARD_KEY]`` say how (Note [both modes in one graph]
in :mod:`fxpipe.tracer.train_eval.modes`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx
import torch.nn as nn
import torch.utils._pytree as pytree

from fxpipe.tracer.call import CallSpec
from fxpipe.tracer.profile import ModelProfile

__all__ = ["TracedModel"]


@dataclass
class TracedModel:
    """A model, its normalized FX graph, and its profile.

    ``unit_of_node`` maps the name of every ``call_module`` / ``call_function`` /
    ``call_method`` node to the name of the profile unit that contains it.
    ``user_leaf_args`` holds, for leaf modules whose class is not from ``torch.nn``, the
    ``(args, kwargs)`` their constructor got (when the model was built with
    :func:`fxpipe.tracer.build_model_recorded`), so a stage file can rebuild them.
    ``example_inputs`` are the tensor inputs of the traced call, and ``call`` says how a
    later call binds to them (``None``: positionally, one tensor per placeholder).
    """

    model: nn.Module
    graph_module: torch.fx.GraphModule
    profile: ModelProfile
    unit_of_node: dict[str, str]
    frontend: str
    output_spec: pytree.TreeSpec
    leaf_modules: dict[str, type] = field(default_factory=dict)
    user_leaf_args: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = field(default_factory=dict)
    example_inputs: tuple[torch.Tensor, ...] = ()
    call: CallSpec | None = None
    static_batch: str = (
        ""  # the line that fixes the batch: a static graph (Note [a batch the model fixes])
    )

    def unflatten_output(self, flat: tuple[Any, ...] | list[Any]) -> Any:
        """Rebuild the model's output structure from the graph's flat output tuple."""
        return pytree.tree_unflatten(list(flat), self.output_spec)

    def nodes_of_unit(self, unit: str) -> list[torch.fx.Node]:
        """The graph nodes of one unit, in graph order."""
        return [n for n in self.graph_module.graph.nodes if self.unit_of_node.get(n.name) == unit]
