"""``RunRecord``: what one training run measured, as ``DIR/run.json``; and the plan whose prediction it reports.

Rank 0 of ``python -m fxpipe.runtime.launch.worker`` writes it; ``run_build`` returns it;
``fxpipe report`` sets ``median_step_ms`` and ``peak_tensor_bytes`` beside the plan's
figures.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.errors import BuildDirError
from fxpipe.jsonio import check_schema_version, dump_json, load_json
from fxpipe.userfiles import shown
from fxpipe.schema import read_dataclass

if TYPE_CHECKING:
    from fxpipe.partitioner import PartitionPlan

__all__ = ["RunRecord", "RUN_RECORD_SCHEMA_VERSION", "read_build_plan"]

RUN_RECORD_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """One run: per-step losses (averaged over replicas) and seconds, the steady-state
    median, the configuration it ran with (options resolved against the build), the plan's
    predicted step (``None`` when the plan was made for another configuration) and each
    rank's peak memory: resident set (``peak_memory_bytes``; CUDA: peak allocated) and
    tensors (``peak_tensor_bytes``, see ``fxpipe.runtime.pipeline.peak_memory``), in rank order. Per step
    too: the learning rate it used (``lrs``) and, with clipping, the global gradient norm
    before clipping (``grad_norms``); ``eval_losses`` as (step, loss) pairs. A resumed run
    keeps the whole history (``losses`` from step 1) and says where it resumed (``first_step``:
    the steps done before; its ``step_seconds`` cover this run's steps only)."""

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
    optimizer: str = "sgd"
    precision: str = "fp32"
    lrs: tuple[float, ...] = ()
    grad_norms: tuple[float, ...] = ()
    eval_losses: tuple[tuple[int, float], ...] = ()
    first_step: int = 0
    schema_version: int = RUN_RECORD_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (sequences as lists)."""
        return {f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v for f in fields(self)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunRecord:
        check_schema_version(data, RUN_RECORD_SCHEMA_VERSION, "run.json", BuildDirError)
        return read_dataclass(cls, data, "run.json", BuildDirError)

    def to_json(self, path: str | Path | None = None) -> str:
        """The record as JSON text, also written to ``path`` when given (an unwritable one is a ``BuildDirError``)."""
        text = dump_json(self.to_dict(), what="run.json", error=BuildDirError)
        if path is not None:
            folder = Path(path).parent
            try:
                Path(path).write_text(text + "\n")
            except OSError as exc:
                why = (f"its folder {shown(folder)} no longer exists (was it removed while the job ran?)"
                       if not folder.exists() else exc.strerror or str(exc))
                raise BuildDirError(f"cannot write {shown(path)}: {why}; the run's record is lost") from None
        return text

    @classmethod
    def from_json(cls, source: str | Path) -> RunRecord:
        """Read a ``run.json`` file (or its JSON text)."""
        return cls.from_dict(load_json(source, "run.json", BuildDirError))


def read_build_plan(build_dir: Path) -> PartitionPlan | None:
    """The build's ``plan.json`` (``None`` when it has none), checked against the manifest's sha256
    and validated BEFORE training starts, so a malformed plan is one error up front and not a
    crash after the last step."""
    from fxpipe.codegen.integrity import check_build

    return check_build(build_dir, [], model=False, weights=False).read_plan()
