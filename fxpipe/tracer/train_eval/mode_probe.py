"""Whether a model computes the same thing in train and eval mode, found by running it, not tracing it.

Note [one mode is enough]: Note [both modes in one graph] traces a model twice, once per mode,
and merges the graphs. Most transformers (no dropout configured, no batch norm) compute the same
function in both modes, and the second trace (a whole ``torch.export`` on the export front end)
was a third of a small model's partition time. So the tracer first runs the model eagerly in
each mode under a dispatch mode that records every ATen call: the operator, its non-tensor
arguments, and for every tensor argument where it came from (a parameter or buffer by name, a
model input by position, or the output of an earlier call by index; any other tensor by shape,
dtype and a fingerprint of its values). Two equal records mean the two modes run the same
operators on the same data in the same order: the eval-mode graph would be the train-mode graph,
and the merge would add no guard, so the second trace is skipped. Any difference at all (a
dropout call, batch norm's other kernel, a running-statistics update, another constant) falls
back to tracing both modes. The record is a sufficient condition, never a heuristic: nothing is
skipped unless the two runs were the same calls on the same values. A graph that calls an operator
taking the mode as an argument (a p=0 dropout, as transformers configure them) is traced in both
modes all the same, so that the stage reads ``F.dropout(x, 0.0, self.training)``, not a literal.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from fxpipe.tracer.seeding import seeded

__all__ = ["graph_takes_mode", "modes_compute_alike", "record_calls"]

Call = tuple[str, tuple[Any, ...]]


class _Differs(Exception):
    """Raised at the first call of the second mode that differs from the first mode's."""


class _Recorder(TorchDispatchMode):
    """Records ATen calls with the provenance of their tensor arguments (Note [one mode is enough]).

    Given ``expected`` (the other mode's calls), it stops the run at the first call that differs.
    """

    def __init__(self, names: dict[int, str], expected: list[Call] | None = None) -> None:
        super().__init__()
        self.labels: dict[int, Any] = dict(names)
        self.calls: list[Call] = []
        self.expected = expected
        self._alive: list[torch.Tensor] = []  # keeps every labelled tensor alive: ids stay unique

    def _label(self, t: torch.Tensor) -> Any:
        label = self.labels.get(id(t))
        if label is not None:
            return label
        return ("other", tuple(t.shape), str(t.dtype), _fingerprint(t))

    def _arg(self, a: Any) -> Any:
        if isinstance(a, torch.Tensor):
            return self._label(a)
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            return (type(a).__name__, repr(a))
        if isinstance(a, (torch.layout, torch.memory_format)):
            return repr(a)
        if isinstance(a, torch.SymInt | torch.SymFloat | torch.SymBool):
            return ("sym", str(a))
        return ("object", type(a).__qualname__, id(a))  # never equal across runs: no skip

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        flat, spec = pytree.tree_flatten((args, kwargs))
        call = (str(func), (str(spec), tuple(self._arg(a) for a in flat)))
        if self.expected is not None and (
            len(self.calls) >= len(self.expected) or self.expected[len(self.calls)] != call
        ):
            raise _Differs
        self.calls.append(call)
        out = func(*args, **kwargs)
        index = len(self.calls) - 1
        for j, t in enumerate(pytree.tree_leaves(out)):
            if isinstance(t, torch.Tensor):
                self.labels[id(t)] = ("call", index, j)
                self._alive.append(t)
        return out


def _fingerprint(t: torch.Tensor) -> Any:
    """A tensor's values in two numbers (``None`` for tensors that hold no values, such as meta)."""
    if t.device.type == "meta" or type(t) not in (torch.Tensor, nn.Parameter) or t.numel() == 0:
        return None
    with torch.no_grad():
        v = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
        v = v.to(torch.float64).flatten()
        return (float(v.sum()), float((v * torch.arange(1, v.numel() + 1, dtype=v.dtype)).sum()))


def record_calls(
    model: nn.Module,
    inputs: tuple[torch.Tensor, ...],
    run: Callable[[], Any],
    expected: list[Call] | None = None,
) -> list[Call]:
    """The ATen calls of ``run()`` (which calls ``model`` on ``inputs``) in the model's current mode;
    with ``expected``, raises ``_Differs`` at the first call that is not the expected one."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), f"param:{name}")
    for name, b in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(b), f"buffer:{name}")
    for i, t in enumerate(inputs):
        names.setdefault(id(t), f"input:{i}")
    recorder = _Recorder(names, expected)
    with torch.enable_grad(), recorder:  # as the trace runs it (see merge_eval_mode)
        run()
    return recorder.calls


def modes_compute_alike(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], run: Callable[[], Any]
) -> bool:
    """Whether ``model`` makes the same calls on the same values in train and in eval mode.

    Runs ``run()`` once per mode from the same RNG state and leaves the model in train mode.
    ``True`` means the eval-mode trace may be skipped (Note [one mode is enough]).
    """
    if any(_differs_by_mode(m) for m in model.modules()):
        return False  # known to differ: no need to run anything
    try:
        model.train()
        with seeded(0, devices=None):
            train = record_calls(model, inputs, run)
        model.eval()
        with seeded(0, devices=None):
            evaluated = record_calls(model, inputs, run, expected=train)
    except Exception:  # _Differs, or anything the probe cannot record: trace both modes
        return False
    finally:
        model.train()
    return len(evaluated) == len(train)


def graph_takes_mode(gm: torch.fx.GraphModule) -> bool:
    """Whether the traced graph calls an operator or layer that takes the mode as an argument
    (dropout, batch or instance norm, RReLU), even one that computes the same in both modes (p=0
    dropout): the eval-mode trace then writes ``self.training`` there instead of a literal, which
    is what a reader of the stage expects (Note [one mode is enough])."""
    for node in gm.graph.nodes:
        if node.op == "call_module":
            module = gm.get_submodule(str(node.target))
            if isinstance(module, _MODE_LAYERS):
                return True
        elif node.op in ("call_function", "call_method"):
            name = getattr(node.target, "__name__", str(node.target))
            if any(word in name for word in _MODE_OPS):
                return True
    return False


_MODE_LAYERS = (
    nn.modules.dropout._DropoutNd,
    nn.modules.batchnorm._BatchNorm,
    nn.modules.instancenorm._InstanceNorm,
    nn.RReLU,
)
_MODE_OPS = ("dropout", "batch_norm", "instance_norm", "rrelu")


def _differs_by_mode(module: nn.Module) -> bool:
    """Modules known to compute another function in eval mode (batch norm with running statistics,
    dropout with p > 0): the probe answers without running the model."""
    if isinstance(module, nn.modules.batchnorm._BatchNorm):
        return module.track_running_stats
    if isinstance(module, nn.modules.dropout._DropoutNd):
        return module.p > 0
    return False
