"""Every rank's ``fxpipe.init`` config is the same one: compared key by key when the job starts.

Ranks that disagree on ``microbatches`` or ``pipeline`` cut the batch or order the actions
differently, and train on with different losses or die inside the backend ("op.preamble.length <=
op.nbytes" from gloo); on ``partitions`` they build different groups and hang. So ``init``
all-gathers each rank's config (a few hundred bytes, once per job) before it uses any of it, and
stops every rank with one ``ConfigError`` naming the first key that differs and each rank's value.
``plan`` is compared by the build it names (its manifest's digest: a copy of the same build at
another path agrees), ``weights`` by the checkpoint's name and size.
"""

from __future__ import annotations

import hashlib
from dataclasses import fields
from pathlib import Path
from typing import Any

import torch.distributed as dist

from fxpipe.errors import ConfigError
from fxpipe.optionspec import seed_keys
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.smp.config import Config

__all__ = ["config_values", "first_difference", "check_same_config"]


def _build_digest(plan: str) -> str:
    try:
        return hashlib.sha256((Path(plan) / "manifest.json").read_bytes()).hexdigest()[:12]
    except OSError:
        return "unreadable"


def _checkpoint_signature(weights: str) -> tuple[str, int]:
    path = Path(weights)
    try:
        size = (
            sum(p.stat().st_size for p in sorted(path.rglob("*")) if p.is_file())
            if path.is_dir()
            else path.stat().st_size
        )
    except OSError:
        size = -1
    return path.name, size


def config_values(cfg: Config) -> dict[str, tuple[Any, str]]:
    """Each config key (the seed's names, the data-parallel keys included): (what is compared, what is shown)."""
    out: dict[str, tuple[Any, str]] = {}
    for f in fields(cfg):
        if f.name != "data_parallel":
            value = getattr(cfg, f.name)
            out[f.name] = (value, repr(value))
    keys = seed_keys(DataParallelOptions)
    for key in sorted(
        keys, key=lambda k: k == "shard_optimizer_state"
    ):  # the older spelling of 'shard' last
        value = getattr(cfg.data_parallel, keys[key])
        out[key] = (value, repr(value))
    if cfg.plan is not None:
        digest = _build_digest(cfg.plan)
        out["plan"] = (digest, f"{cfg.plan!r} (manifest {digest})")
    if cfg.weights is not None:
        name, size = _checkpoint_signature(cfg.weights)
        out["weights"] = ((name, size), f"{cfg.weights!r} ({size} bytes)")
    return out


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    shown = ", ".join(map(str, ranks[:4])) + (
        f", ... ({len(ranks)} ranks)" if len(ranks) > 4 else ""
    )
    return f"ranks {shown}"


def first_difference(per_rank: list[dict[str, tuple[Any, str]]]) -> str | None:
    """The message for the first key whose value differs between the ranks (``None`` if all agree).

    >>> first_difference([{"microbatches": (4, "4")}, {"microbatches": (2, "2")}])
    "config 'microbatches' differs across ranks (rank 0: 4, rank 1: 2); every rank must call fxpipe.init with the same config"
    """
    for key in per_rank[0]:
        values = [config.get(key, (None, "absent")) for config in per_rank]
        if all(v[0] == values[0][0] for v in values):
            continue
        groups: dict[str, list[int]] = {}
        for rank, (_, shown) in enumerate(values):
            groups.setdefault(shown, []).append(rank)
        listed = ", ".join(f"{_ranks(ranks)}: {shown}" for shown, ranks in groups.items())
        return (
            f"config {key!r} differs across ranks ({listed}); every rank must call fxpipe.init with the same "
            "config"
        )
    return None


def check_same_config(cfg: Config, group: Any = None) -> None:
    """Refuse (on every rank) a config that differs between the ranks of ``group``; collective."""
    per_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, config_values(cfg), group=group)
    message = first_difference(per_rank)
    if message is not None:
        raise ConfigError(message)
