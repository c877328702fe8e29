"""Process groups from torchrun's environment: backend, timeout, pipeline/DP/tie groups.

NCCL when the stage runs on CUDA, gloo on CPU. Every rank creates every group in the
same order (``dist.new_group`` is collective over the whole world), even groups it is
not a member of.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import RuntimeSetupError
from fxpipe.runtime.pipeline.layout import RankLayout

__all__ = [
    "DistEnv",
    "read_env",
    "this_rank",
    "pick_device",
    "init_process_group",
    "backend_for",
    "Groups",
    "build_groups",
]


@dataclass(frozen=True)
class DistEnv:
    """The variables torchrun sets for each worker."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def read_env() -> DistEnv:
    """Read RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT."""
    values = {}
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise RuntimeSetupError(
                f"environment variable {key} is not set: start the workers with torchrun, e.g. "
                "`torchrun --nproc-per-node N -m fxpipe.runtime.launch.worker DIR`, or use `fxpipe run DIR`"
            )
        values[key] = os.environ[key]
    try:
        return DistEnv(
            int(values["RANK"]),
            int(values["WORLD_SIZE"]),
            int(os.environ.get("LOCAL_RANK", "0")),
            values["MASTER_ADDR"],
            int(values["MASTER_PORT"]),
        )
    except ValueError as exc:
        raise RuntimeSetupError(f"torchrun environment is malformed: {exc}") from None


def this_rank() -> tuple[int, int, int]:
    """(rank, world size, local rank): from the default process group when one exists
    (a script may have initialised it itself), else from torchrun's environment."""
    if dist.is_initialized():
        rank = dist.get_rank()
        return rank, dist.get_world_size(), int(os.environ.get("LOCAL_RANK", rank))
    env = read_env()
    return env.rank, env.world_size, env.local_rank


def pick_device(device: str | torch.device | None, local_rank: int) -> torch.device:
    """``device`` if given, else ``cuda:LOCAL_RANK`` when CUDA is available, else CPU."""
    if device is not None:
        dev = torch.device(device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise RuntimeSetupError(
                f"device {str(device)!r} was asked for, but this torch sees no CUDA device; "
                "leave the device out to use the CPU"
            )
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", local_rank)
        return dev
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """The process group's backend for ranks on ``device``: NCCL on CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_process_group(device: torch.device, timeout_s: float) -> bool:
    """Initialise the default group (NCCL for CUDA, gloo otherwise) unless it exists.

    Returns whether this call created it (and so should destroy it).
    """
    if dist.is_initialized():
        return False
    backend = backend_for(device)
    kwargs: dict[str, Any] = {}
    if device.type == "cuda":
        torch.cuda.set_device(device)
        kwargs["device_id"] = device
    try:
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
    except (RuntimeError, ValueError) as exc:
        raise RuntimeSetupError(
            f"could not initialise the {backend} process group "
            f"(MASTER_ADDR={os.environ.get('MASTER_ADDR')}, "
            f"MASTER_PORT={os.environ.get('MASTER_PORT')}): {exc}"
        ) from exc
    return True


@dataclass(frozen=True)
class Groups:
    """This rank's groups: its pipeline, its data-parallel peers and its tied parameters.

    ``ties`` holds, for each tie this rank takes part in, the parameter key on this rank's
    copy and the group of the ranks that hold a copy (same replica); ``tie_stages[i]`` is
    the stage whose module holds the copy of ``ties[i]``. Stages of one rank share a tied
    parameter in memory (``share_tied_parameters``), so a tie held by one rank only needs
    no group.
    """

    layout: RankLayout
    pipeline: dist.ProcessGroup | None
    data_parallel: dist.ProcessGroup | None
    ties: tuple[tuple[str, dist.ProcessGroup], ...]
    tie_stages: tuple[int, ...] = ()


def build_groups(layout: RankLayout, manifest: Manifest, rank: int) -> Groups:
    """Create all groups on all ranks in one fixed order and keep this rank's.

    With tensor parallelism each tp index has its own pipelines, data-parallel and tie groups
    (Note [DTensor regions] in ``fxpipe.runtime.pipeline.tensor_parallel``)."""
    stage, replica = layout.stage_of(rank), layout.replica_of(rank)
    tp, tps = layout.tp_of(rank), range(layout.tensor_parallel)
    stage_ranks = manifest.stage_ranks
    pipeline = data_parallel = None
    if layout.replicas > 1 or layout.tensor_parallel > 1:
        for r in range(layout.replicas):
            for t in tps:
                g = dist.new_group(list(layout.pipeline_ranks(r, t)))
                if (r, t) == (replica, tp):
                    pipeline = g
    if layout.replicas > 1:
        for s in range(layout.num_stages):
            for t in tps:
                g = dist.new_group(list(layout.data_parallel_ranks(s, t)))
                if (s, t) == (stage, tp):
                    data_parallel = g
    ties, tie_stages = [], []
    for tie in manifest.ties:
        holders = sorted({stage_ranks[s] for s in tie.stages})
        if len(holders) < 2:
            continue
        for r in range(layout.replicas):
            for t in tps:
                g = dist.new_group([layout.rank_of(p, r, t) for p in holders])
                if (r, t) == (replica, tp) and stage in holders:
                    first = next(i for i, s in enumerate(tie.stages) if stage_ranks[s] == stage)
                    ties.append((tie.keys[first], g))
                    tie_stages.append(tie.stages[first])
    return Groups(layout, pipeline, data_parallel, tuple(ties), tuple(tie_stages))
