"""DDP communication hooks by name, and the PowerSGD state as checkpointable data.

``make_comm_hook("powersgd", group)`` returns the ``(state, hook)`` pair that
``DistributedDataParallel.register_comm_hook`` takes, from
``torch.distributed.algorithms.ddp_comm_hooks``. A stateful hook's state is saved with
its own ``__getstate__`` and restored *into the registered state object* with
``__setstate__`` (DDP accepts one ``register_comm_hook`` per model), after which its
process group is reset to the data-parallel group (``__setstate__`` sets the world).
The PowerSGD random generator (a numpy ``RandomState``) is stored as tensors so the
checkpoint loads with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from fxpipe.errors import ConfigError
from fxpipe.runtime.dataparallel.options import COMM_HOOKS

__all__ = ["make_comm_hook", "hook_state_dict", "load_hook_state_dict", "CommHook"]

CommHook = Callable[[Any, dist.GradBucket], torch.futures.Future]

_RNG_KEY = "rng"


def make_comm_hook(
    name: str, group: dist.ProcessGroup | None, powersgd_rank: int = 1, powersgd_start_iter: int = 2
) -> tuple[Any, CommHook]:
    """The ``(state, hook)`` of the built-in hook called ``name`` over ``group``."""
    if name == "allreduce":
        return group, default_hooks.allreduce_hook
    if name == "fp16":
        return group, default_hooks.fp16_compress_hook
    if name == "bf16":
        backend = dist.get_backend(group)
        if backend != "nccl":  # DDP itself refuses the bf16 hooks without CUDA and NCCL >= 2.10
            raise ConfigError(
                f"comm_hook 'bf16' needs CUDA with NCCL >= 2.10, but the data-parallel group uses "
                f"{backend!r}; use comm_hook='fp16' (the same halving of the bytes) on this backend"
            )
        return group, default_hooks.bf16_compress_hook
    if name == "batched_powersgd" and not _batched_powersgd_works():
        raise ConfigError(
            f"comm_hook 'batched_powersgd' fails in torch {torch.__version__}: its "
            "batched_powerSGD_hook passes a 2-D matrix to _orthogonalize, which accepts only batches "
            "(3-D); use comm_hook='powersgd' (per-tensor PowerSGD, the more accurate variant)"
        )
    if name in ("powersgd", "batched_powersgd"):
        state = powerSGD_hook.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=powersgd_rank,
            start_powerSGD_iter=powersgd_start_iter,
            random_seed=0,
        )
        hook = (
            powerSGD_hook.powerSGD_hook
            if name == "powersgd"
            else powerSGD_hook.batched_powerSGD_hook
        )
        return state, hook
    raise ConfigError(f"unknown comm_hook {name!r}; expected one of {list(COMM_HOOKS)}")


@functools.cache
def _batched_powersgd_works() -> bool:
    """Whether this torch's ``batched_powerSGD_hook`` can orthogonalize its one 2-D ``Q`` matrix."""
    try:
        powerSGD_hook._orthogonalize(torch.ones(2, 1))
    except AssertionError:
        return False
    return True


def hook_state_dict(state: Any) -> dict[str, Any] | None:
    """A stateful hook's state as plain data (``None`` for stateless hooks, whose state is a group)."""
    if state is None or isinstance(state, dist.ProcessGroup) or not hasattr(state, "__getstate__"):
        return None
    data = dict(state.__getstate__())
    rng = data.get(_RNG_KEY)
    if isinstance(rng, np.random.RandomState):
        legacy = rng.get_state(legacy=True)
        assert isinstance(legacy, tuple), (
            "powerSGD seeds an MT19937 RandomState, whose legacy state is a tuple"
        )
        kind, keys, pos, has_gauss, gauss = legacy
        data[_RNG_KEY] = {
            "kind": kind,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "gauss": float(gauss),
        }
    return data


def load_hook_state_dict(
    state: Any, data: dict[str, Any] | None, group: dist.ProcessGroup | None
) -> None:
    """Restore ``data`` (from ``hook_state_dict``) into the registered hook ``state`` in place."""
    if data is None:
        return
    if state is None or isinstance(state, dist.ProcessGroup) or not hasattr(state, "__setstate__"):
        raise ConfigError(
            f"the checkpoint holds the state of a stateful communication hook (keys "
            f"{sorted(data)[:4]}...), but this model's hook is stateless; register the same hook "
            "(e.g. comm_hook='powersgd') before loading"
        )
    data = dict(data)
    rng = data.get(_RNG_KEY)
    if isinstance(rng, dict):
        gen = np.random.RandomState()
        gen.set_state(
            (
                rng["kind"],
                rng["keys"].numpy().astype(np.uint32),
                rng["pos"],
                rng["has_gauss"],
                rng["gauss"],
            )
        )
        data[_RNG_KEY] = gen
    state.__setstate__(data)
    state.process_group = group
