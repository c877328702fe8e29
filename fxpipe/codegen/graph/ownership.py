"""Which parameters, buffers and constants each stage owns, and which are tied across stages.

Keys are the original model's ``state_dict`` keys. One tensor reachable under several
keys (tied weights, e.g. GPT's ``wte.weight`` / ``lm_head.weight``) is grouped by
identity (``named_parameters(remove_duplicate=False)``): inside a stage every key of
the group points at one Parameter (the first key is stored, the rest are aliases),
and across stages each stage holds a copy and the manifest records a ``Tie`` so the
runtime can sum their gradients.

Note [frozen parameters]: a parameter the model froze (``requires_grad=False``: a frozen
embedding or tower, the base under LoRA adapters) is frozen in its stage too, so it gets no
gradient, no optimizer state and no data-parallel traffic. The stage source says so: a
parameter a generated class creates is ``torch.nn.Parameter(..., requires_grad=False)``, one
that a layer's constructor creates is frozen after it by a ``requires_grad_(False)`` line of the
stage's ``__init__`` (``ModuleTree.frozen_lines``). Loading keeps the flag (``load_state_dict(assign=True)``
and the meta initialiser copy it from the module built from the source), the safety net and
``fxpipe verify`` compare it (a ``requires_grad KEY`` row: a frozen parameter has no gradient on
either side), and the runtime builds optimizers, DDP, ZeRO and FSDP2 over the trainable
parameters only (``stage_optimizer``, ``ReplicatedStage``). ``requires_grad`` is the only flag a
parameter carries that torch's training reads; other attributes set on a parameter object are
not carried.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Mapping

import torch
import torch.fx as fx
import torch.nn as nn

from fxpipe.codegen.manifest import Tie
from fxpipe.errors import CodegenError
from fxpipe.unexpected import disk_error

__all__ = [
    "TensorEntry",
    "StageState",
    "stage_state",
    "tensor_aliases",
    "tied_groups",
    "save_weights",
    "alias_chooser",
]

PARAMETER, BUFFER, CONSTANT = "parameter", "buffer", "constant"


@dataclass(frozen=True)
class TensorEntry:
    """One key a stage owns: ``kind`` is parameter, buffer (persistent) or constant
    (non-persistent buffer); ``leaf`` says whether a leaf module creates it itself."""

    key: str
    tensor: torch.Tensor
    kind: str
    leaf: bool


@dataclass(frozen=True)
class StageState:
    """A stage's tensors in model order and its in-stage aliases ``alias -> stored key``."""

    entries: tuple[TensorEntry, ...]
    aliases: Mapping[str, str]

    @property
    def stored(self) -> tuple[TensorEntry, ...]:
        """The entries written to the weights file (aliases are not)."""
        return tuple(e for e in self.entries if e.key not in self.aliases)

    def keys(self, kind: str) -> tuple[str, ...]:
        return tuple(e.key for e in self.entries if e.kind == kind)


def tensor_aliases(model: nn.Module) -> dict[int, list[str]]:
    """``id(tensor) -> every key naming it`` over the model's parameters and buffers, in model order."""
    groups: dict[int, list[str]] = {}
    for key, t in list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    ):
        groups.setdefault(id(t), []).append(key)
    return groups


def alias_chooser(gm: fx.GraphModule, model: nn.Module) -> Callable[[str, Iterable[str]], str]:
    """``choose(target, user_paths)``: the key of a tied tensor that matches the module paths reading it.

    torch.export routes every use of a tied tensor through one name (GPT-2's embedding
    reads ``lm_head.weight``); choosing per stage gives each stage the key of its own module.
    """
    groups = tensor_aliases(model)

    def choose(target: str, user_paths: Iterable[str]) -> str:
        keys = groups.get(id(_fetch(gm, model, target)), [])
        paths = list(user_paths)
        if len(keys) < 2 or not paths:
            return target

        def score(key: str) -> int:
            return max(_prefix_len(key.rpartition(".")[0], p) for p in paths)

        best = max(keys, key=score)
        return target if score(target) >= score(best) else best

    return choose


def _prefix_len(module_path: str, node_path: str) -> int:
    a, b = module_path.split("."), node_path.split(".")
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n] and a[n]:
        n += 1
    return n


def _fetch(gm: fx.GraphModule, model: nn.Module, target: str) -> object:
    for root in (gm, model):
        obj: object = root
        try:
            for part in target.split("."):
                obj = getattr(obj, part)
            return obj
        except AttributeError:
            continue
    raise CodegenError(
        f"get_attr target {target!r} is neither on the traced graph module nor on the model"
    )


def _persistent(model: nn.Module, key: str, constants: set[str]) -> bool:
    if key in constants:
        return False
    owner_path, _, name = key.rpartition(".")
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        return False
    return name in owner._buffers and name not in owner._non_persistent_buffers_set


def stage_state(
    gm: fx.GraphModule,
    model: nn.Module,
    modules: Iterable[str],
    attrs: Iterable[str],
    constants: set[str],
) -> StageState:
    """The tensors a stage owns: everything inside its leaf modules plus its ``get_attr`` tensors."""
    found: dict[str, TensorEntry] = {}
    for path in modules:
        leaf = gm.get_submodule(path)
        persistent = set(leaf.state_dict(prefix=f"{path}.", keep_vars=True))
        for key, p in leaf.named_parameters(prefix=path, remove_duplicate=False):
            found[key] = TensorEntry(key, p, PARAMETER, True)
        for key, b in leaf.named_buffers(prefix=path, remove_duplicate=False):
            found[key] = TensorEntry(key, b, BUFFER if key in persistent else CONSTANT, True)
    for target in attrs:
        obj = _fetch(gm, model, target)
        if isinstance(obj, nn.Module):
            continue  # a higher-order-op subgraph: emitted as code, owns no tensors
        if target in found:
            continue
        if not isinstance(obj, torch.Tensor):
            raise CodegenError(
                f"get_attr target {target!r} is a {type(obj).__name__}; expected a tensor or module"
            )
        if isinstance(obj, nn.Parameter):
            kind = PARAMETER
        else:
            kind = BUFFER if _persistent(model, target, constants) else CONSTANT
        found[target] = TensorEntry(target, obj, kind, False)
    named = list(model.named_parameters(remove_duplicate=False)) + list(
        model.named_buffers(remove_duplicate=False)
    )
    order = {k: i for i, (k, _) in enumerate(named)}
    entries = sorted(
        found.values(), key=lambda e: (order.get(e.key, len(order)), e.key)
    )  # model order
    first: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for e in entries:
        if id(e.tensor) in first:
            aliases[e.key] = first[id(e.tensor)]
        else:
            first[id(e.tensor)] = e.key
    return StageState(entries=tuple(entries), aliases=aliases)


def tied_groups(states: list[StageState]) -> tuple[Tie, ...]:
    """Parameters held by more than one stage, as ``Tie(stages, stored keys)``."""
    holders: dict[int, list[tuple[int, str]]] = {}
    for s, state in enumerate(states):
        for e in state.stored:
            if e.kind == PARAMETER:
                holders.setdefault(id(e.tensor), []).append((s, e.key))
    ties = [
        Tie(stages=tuple(s for s, _ in h), keys=tuple(k for _, k in h))
        for h in holders.values()
        if len(h) > 1
    ]
    return tuple(sorted(ties, key=lambda t: (t.stages, t.keys)))


def save_weights(state: StageState, path: Path) -> None:
    """Write the stage's stored tensors (each cloned: safetensors refuses shared storage). A full
    disk is an ``OSError`` naming ``path`` (safetensors' own error does not say which file)."""
    from safetensors.torch import save_file

    tensors = {e.key: e.tensor.detach().to("cpu").clone().contiguous() for e in state.stored}
    try:
        save_file(tensors, str(path), metadata={"format": "pt", "written_by": "fxpipe"})
    except Exception as exc:
        fault = disk_error(exc)
        if fault is None:
            raise
        raise OSError(fault.errno, fault.strerror, str(path)) from None
