"""``RunRecord``: what one training run measured, as ``DIR/run.json``; and the plan's prediction to compare.

Rank 0 of ``python -m fxpipe.runtime.worker`` writes it; ``run_build`` returns it;
``benchmarks/prediction/`` compares ``median_step_ms`` and ``peak_tensor_bytes`` with
the plan's figures.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from fxpipe.errors import BuildDirError
from fxpipe.jsonio import check_schema_version, dump_json, load_json

__all__ = ["RunRecord", "RUN_RECORD_SCHEMA_VERSION", "predicted_step_ms"]

RUN_RECORD_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One run: per-step losses (averaged over replicas) and seconds, the steady-state
    median, the configuration it ran with (options resolved against the build), the plan's
    predicted step (``None`` when the plan was made for another configuration) and each
    rank's peak memory: resident set (``peak_memory_bytes``; CUDA: peak allocated) and
    tensors (``peak_tensor_bytes``, see ``fxpipe.runtime.memory``), in rank order."""

    losses: tuple[float, ...]
    step_seconds: tuple[float, ...]
    median_step_ms: float
    samples_per_second: float
    schedule: str
    microbatches: int
    batch_size: int
    lr: float
    world_size: int
    num_stages: int
    device: str
    backend: str
    predicted_step_ms: float | None
    peak_memory_bytes: tuple[int, ...]
    peak_tensor_bytes: tuple[int, ...]
    dp: int
    global_batch_size: int
    comm_hook: str
    powersgd_rank: int
    shard_optimizer_state: bool
    backward_passes_per_step: int
    schema_version: int = RUN_RECORD_SCHEMA_VERSION

    def __post_init__(self) -> None:
        for f in fields(self):  # JSON lists in, tuples kept: the record is a value
            if isinstance(getattr(self, f.name), list):
                object.__setattr__(self, f.name, tuple(getattr(self, f.name)))

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (sequences as lists)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        check_schema_version(data, RUN_RECORD_SCHEMA_VERSION, "run.json", BuildDirError)
        known = {f.name for f in fields(cls)}
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as exc:
            raise BuildDirError(f"run.json is malformed: {exc}") from None

    def to_json(self, path: str | Path | None = None) -> str:
        return dump_json(self.to_dict(), path)

    @classmethod
    def from_json(cls, source: str | Path) -> RunRecord:
        """Read a ``run.json`` file (or its JSON text)."""
        return cls.from_dict(load_json(source, "run.json", BuildDirError))


def predicted_step_ms(build_dir: Path, schedule: str, microbatches: int, dp: int = 1,
                      comm_hook: str = "allreduce", powersgd_rank: int = 1) -> float | None:
    """The plan's predicted step time for ``schedule``, if ``plan.json`` has one for these
    microbatches and was priced for ``dp`` replicas with ``comm_hook`` (and PowerSGD's rank):
    its all-reduce is in it."""
    path = build_dir / "plan.json"
    if not path.is_file():
        return None
    plan = json.loads(path.read_text())
    if plan.get("microbatches") not in (None, microbatches):
        return None
    cost = plan.get("cost", {})
    if cost.get("dp_replicas", 1) != dp or (dp > 1 and cost.get("comm_hook", "allreduce") != comm_hook):
        return None
    if dp > 1 and "powersgd" in comm_hook and cost.get("powersgd_rank", 1) != powersgd_rank:
        return None
    value = plan.get("prediction", {}).get("step_ms", {}).get(schedule)
    return float(value) if value is not None else None
