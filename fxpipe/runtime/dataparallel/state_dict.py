"""Checkpoints of a stage whose training state is sharded over its data-parallel group.

Two formats, both for every sharding level (``none``, ``optimizer``, ``grad-op``, ``full``):

* **full**: ``DIR/stage_<i>.pt``, one ``torch.save`` file per stage written by the
  group's first rank: ``{"model": ..., "optimizer": ...}`` gathered to whole tensors on
  the CPU under the original model's keys, the optimizer state keyed by parameter name
  (the format of ``torch.distributed.checkpoint.state_dict``). It loads into any sharding
  level and any number of replicas, and with ``torch.load(weights_only=True)``.
* **sharded**: ``DIR/stage_<i>/``, a ``torch.distributed.checkpoint`` (DCP) directory
  written by every rank of the group, each its own shards, nothing gathered. FSDP's
  DTensors are resharded by DCP on load; ZeRO's per-rank optimizer shards (level
  ``optimizer``) are stored under their parameters' names, each by its owner.

Both are atomic: a file goes to a temporary name and is moved into place with
``os.replace``; a DCP directory is written under a temporary name and swapped in (the
old one moved aside first and deleted last: a crash between the two moves leaves the
old checkpoint as ``stage_<i>.old``, which ``load_stage_checkpoint`` falls back to).
All functions here are collective over the stage's data-parallel group (``group``;
``None`` with a single replica).

The model and optimizer state dicts come from torch's own
``torch.distributed.checkpoint.state_dict`` (``get_state_dict`` / ``set_state_dict``,
``full_state_dict=True`` for the full format), which understands FSDP2's DTensors;
only ZeRO's optimizer is mapped to parameter names here.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.utils._pytree import tree_leaves, tree_map

from fxpipe.errors import CheckpointError

__all__ = [
    "full_state_dicts",
    "load_full_state_dicts",
    "save_stage_checkpoint",
    "load_stage_checkpoint",
    "checkpoint_paths",
    "gather_full",
    "gather_if_sharded",
    "shard_like",
    "shard_optimizer_state",
    "is_sharded",
    "stage_state_dict",
    "load_stage_state_dict",
]

_FULL = StateDictOptions(full_state_dict=True)
# Loading: a parameter that never had a gradient has no optimizer state in the checkpoint
# (torch's strict check refuses that); the model's keys are checked here instead.
_LOAD = StateDictOptions(strict=False)
_LOAD_FULL = StateDictOptions(full_state_dict=True, strict=False)


def checkpoint_paths(directory: str | os.PathLike[str], stage_index: int) -> tuple[Path, Path]:
    """(full file, sharded directory) of stage ``stage_index`` in ``directory``."""
    d = Path(directory)
    return d / f"stage_{stage_index}.pt", d / f"stage_{stage_index}"


def _group_rank(group: dist.ProcessGroup | None) -> int:
    return dist.get_rank(group) if dist.is_initialized() and group is not None else 0


def _barrier(group: dist.ProcessGroup | None) -> None:
    if dist.is_initialized() and group is not None:
        dist.barrier(group=group)


def _cpu(tree: Any) -> Any:
    """``tree`` with its tensors copied to the CPU (copies: a snapshot, not the live state)."""
    return tree_map(
        lambda x: x.detach().to("cpu", copy=True) if isinstance(x, torch.Tensor) else x, tree
    )


# -- DTensors to whole tensors and back (torch's int-keyed optimizer format, the seed API's) ---------------


def is_sharded(module: nn.Module) -> bool:
    """Whether ``module`` holds FSDP2 shards (DTensor parameters)."""
    return any(isinstance(p, DTensor) for p in module.parameters())


def gather_full(tree: Any) -> Any:
    """``tree`` with every DTensor gathered into a whole CPU tensor (collective over its mesh, in
    the tree's order, which is the same on every rank), other tensors copied to the CPU."""
    return _cpu(tree_map(lambda x: x.full_tensor() if isinstance(x, DTensor) else x, tree))


def shard_like(value: Any, like: torch.Tensor) -> Any:
    """``value`` cut to this rank's shard of DTensor ``like`` when it is a whole tensor of its shape."""
    if (
        isinstance(like, DTensor)
        and isinstance(value, torch.Tensor)
        and not isinstance(value, DTensor)
        and tuple(value.shape) == tuple(like.shape)
    ):
        return distribute_tensor(
            value.to(like.device), like.device_mesh, like.placements, src_data_rank=None
        )
    return value


def shard_optimizer_state(
    state_dict: dict[str, Any], optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """A whole torch-format optimizer state dict (int keys) with each parameter's state cut to
    the shards ``optimizer`` steps (no communication: every rank keeps its own cut)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    ids = [i for g in state_dict["param_groups"] for i in g["params"]]
    by_id = dict(zip(ids, params))
    state = {
        i: {k: shard_like(v, by_id[i]) for k, v in s.items()} if i in by_id else s
        for i, s in state_dict["state"].items()
    }
    return {**state_dict, "state": state}


def gather_if_sharded(tree: Any) -> Any:
    """``gather_full(tree)`` when it holds DTensors (collective), else ``tree`` as it is."""
    return gather_full(tree) if any(isinstance(x, DTensor) for x in tree_leaves(tree)) else tree


def stage_state_dict(module: nn.Module) -> dict[str, Any]:
    """``module.state_dict()`` with FSDP shards gathered into whole tensors (collective when sharded)."""
    return gather_if_sharded(module.state_dict())


def load_stage_state_dict(
    module: nn.Module, state: dict[str, Any], strict: bool = True, assign: bool = False
) -> Any:
    """``module.load_state_dict`` of whole tensors, each cut to this rank's shard when ``module`` is sharded."""
    if not is_sharded(module):
        return module.load_state_dict(state, strict=strict, assign=assign)
    local = module.state_dict()
    return module.load_state_dict(
        {k: shard_like(v, local[k]) if k in local else v for k, v in state.items()},
        strict=strict,
        assign=assign,
    )


# -- ZeRO (level "optimizer"): its state by parameter name ------------------------------------------


def _names(module: nn.Module) -> dict[int, str]:
    return {id(p): name for name, p in module.named_parameters()}


def _zero_full(
    module: nn.Module, zero: ZeroRedundancyOptimizer, group: dist.ProcessGroup | None
) -> dict[str, Any]:
    """ZeRO's consolidated state keyed by parameter name (collective; complete on the group's first rank)."""
    zero.consolidate_state_dict(to=0)  # a rank of ZeRO's own group
    if _group_rank(group) != 0:
        return {}
    sd = zero.state_dict()
    names = _names(module)
    ordered = [names[id(p)] for g in zero.param_groups for p in g["params"]]
    return {
        "state": {ordered[i]: s for i, s in sd["state"].items()},
        "param_groups": [
            {**g, "params": [ordered[i] for i in g["params"]]} for g in sd["param_groups"]
        ],
    }


def _zero_load_full(module: nn.Module, zero: ZeroRedundancyOptimizer, osd: dict[str, Any]) -> None:
    names = _names(module)
    index = {
        names[id(p)]: i for i, p in enumerate(p for g in zero.param_groups for p in g["params"])
    }
    zero.load_state_dict(
        {
            "state": {index[k]: v for k, v in osd["state"].items()},
            "param_groups": [
                {**g, "params": [index[k] for k in g["params"]]} for g in osd["param_groups"]
            ],
        }
    )


def _zero_local(module: nn.Module, zero: ZeroRedundancyOptimizer) -> dict[str, Any]:
    """This rank's ZeRO shard of the optimizer state, keyed by parameter name."""
    names = _names(module)
    return {
        "state": {names[id(p)]: s for p, s in zero.optim.state.items()},
        "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in zero.param_groups],
    }


# -- the full format -------------------------------------------------------------------------------


def full_state_dicts(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, group: dist.ProcessGroup | None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(model, optimizer) state dicts gathered to whole CPU tensors under the original keys
    (collective over ``group``; under ZeRO the optimizer's is complete only on the group's first rank)."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        return _cpu(module.state_dict()), _cpu(_zero_full(module, optimizer, group))
    if optimizer is None:
        return _cpu(get_state_dict(module, [], options=_FULL)[0]), {}
    msd, osd = get_state_dict(module, optimizer, options=_FULL)
    return _cpu(msd), _cpu(osd)


def load_full_state_dicts(
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    model: dict[str, Any],
    optim: dict[str, Any],
) -> None:
    """Load what ``full_state_dicts`` returned into ``module`` / ``optimizer`` at any sharding level."""
    missing = sorted(set(module.state_dict()) - set(model))
    if missing:
        raise CheckpointError(
            f"the checkpoint has no {missing[:4]}: it was saved from another model or partitioning"
        )
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        module.load_state_dict(model)
        _zero_load_full(module, optimizer, optim)
        return
    set_state_dict(
        module,
        [optimizer] if optimizer is not None else [],
        model_state_dict=model,
        optim_state_dict=optim if optimizer is not None else {},
        options=_LOAD_FULL,
    )
    _drop_unsaved(module, optimizer, optim)


def _drop_unsaved(
    module: nn.Module, optimizer: torch.optim.Optimizer | None, optim: dict[str, Any]
) -> None:
    """Forget the state torch made up (to load into) for parameters the checkpoint has none of."""
    if optimizer is None:
        return
    saved = optim.get("state", {})
    for name, p in module.named_parameters():
        if name not in saved:
            optimizer.state.pop(p, None)


# -- save and load ----------------------------------------------------------------------------------


def save_stage_checkpoint(
    directory: str | os.PathLike[str],
    stage_index: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None,
    *,
    sharded: bool = True,
) -> Path:
    """Write stage ``stage_index``'s model and optimizer state into ``directory`` (see the module
    docstring for the formats); returns the file or directory written. Collective over ``group``."""
    full, shards = checkpoint_paths(directory, stage_index)
    Path(directory).mkdir(parents=True, exist_ok=True)
    if not sharded:
        model, optim = full_state_dicts(module, optimizer, group)
        if _group_rank(group) == 0:
            fd, tmp = tempfile.mkstemp(prefix=f".{full.name}.", suffix=".tmp", dir=full.parent)
            try:
                with os.fdopen(fd, "wb") as out:
                    torch.save({"model": model, "optimizer": optim}, out)
                os.replace(tmp, full)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        _barrier(group)
        return full
    staging = shards.with_name(f".{shards.name}.tmp")
    if _group_rank(group) == 0:
        shutil.rmtree(staging, ignore_errors=True)
    _barrier(group)
    dcp.save(
        _sharded_state(module, optimizer),
        checkpoint_id=staging,
        process_group=group,
        no_dist=group is None,
    )
    _barrier(group)
    if _group_rank(group) == 0:
        old = shards.with_name(f"{shards.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        if shards.exists():
            os.replace(shards, old)
        os.replace(staging, shards)
        shutil.rmtree(old, ignore_errors=True)
    _barrier(group)
    return shards


def _sharded_state(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The state DCP saves and loads in place: FSDP's DTensor shards, ZeRO's own shard by name."""
    if isinstance(optimizer, ZeroRedundancyOptimizer):
        if not optimizer.optim.state:  # DCP loads in place: ZeRO's lazy state must exist first
            from torch.distributed.checkpoint.state_dict import _init_optim_state

            _init_optim_state(optimizer.optim)
        return {"model": module.state_dict(), "optimizer": _zero_local(module, optimizer)}
    model, optim = get_state_dict(module, [optimizer] if optimizer is not None else [])
    return {"model": model, "optimizer": optim}


def _keep_saved(state: dict[str, Any], saved: set[str], where: Path) -> None:
    """Drop the optimizer state of parameters that had none when saved (never stepped, e.g.
    unused); DCP loads in place, and the state made to load into would otherwise survive."""
    missing = [k for k in state["model"] if f"model.{k}" not in saved]
    if missing:
        raise CheckpointError(
            f"the sharded checkpoint {where} has no {missing[:4]}: it was saved from another "
            "model or partitioning"
        )
    per_param = state["optimizer"].get("state", {})
    for name in [
        n for n in per_param if not any(k.startswith(f"optimizer.state.{n}.") for k in saved)
    ]:
        del per_param[name]


def load_stage_checkpoint(
    directory: str | os.PathLike[str],
    stage_index: int,
    module: nn.Module,
    optimizer: torch.optim.Optimizer | None,
    group: dist.ProcessGroup | None,
) -> None:
    """Restore stage ``stage_index`` from ``directory``, full or sharded (whichever was saved;
    a sharded one interrupted while being swapped in is read from ``stage_<i>.old``). Collective."""
    full, shards = checkpoint_paths(directory, stage_index)
    old = shards.with_name(f"{shards.name}.old")
    if not shards.is_dir() and old.is_dir():
        shards = old
    if shards.is_dir():
        state = _sharded_state(module, optimizer)
        reader = dcp.FileSystemReader(shards)
        _keep_saved(state, set(reader.read_metadata().state_dict_metadata), shards)
        dcp.load(state, storage_reader=reader, process_group=group, no_dist=group is None)
        if isinstance(optimizer, ZeroRedundancyOptimizer):
            # DCP loaded the tensors in place and replaced the other values in the shard's own
            # state dicts; the options (lr...) go to ZeRO's groups, which it copies to the shard at step()
            module.load_state_dict(state["model"])
            for mine, saved in zip(optimizer.param_groups, state["optimizer"]["param_groups"]):
                mine.update(saved)
            names, kept = _names(module), set(state["optimizer"]["state"])
            for p in [p for p in optimizer.optim.state if names[id(p)] not in kept]:
                del optimizer.optim.state[p]
        else:
            set_state_dict(
                module,
                [optimizer] if optimizer is not None else [],
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
                options=_LOAD,
            )
            _drop_unsaved(module, optimizer, state["optimizer"])
        return
    if not full.is_file():
        raise CheckpointError(
            f"no checkpoint of stage {stage_index} in {directory}: neither {full.name} (full) nor "
            f"{shards.name}/ (sharded); was it saved with save_stage_checkpoint by a job with this "
            "partitioning?"
        )
    try:
        data = torch.load(full, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise CheckpointError(f"cannot read checkpoint {full}: {exc}") from exc
    load_full_state_dicts(module, optimizer, data["model"], data["optimizer"])
