"""``RunRecord``: what one training run measured, as ``DIR/run.json``; and the plan whose prediction it reports.

Rank 0 of ``python -m fxpipe.runtime.launch.worker`` writes it; ``run_build`` returns it;
``fxpipe report`` sets ``median_step_ms`` and ``peak_tensor_bytes`` beside the plan's
figures.

Note [a record names its build]: a run records the sha256 of the ``manifest.json`` it loaded
(``build_sha256``; the manifest holds the hash of every file of the build, so it names the
build). ``fxpipe partition --out`` may replace the build directory while a run trains (Note
[build directory swap] in ``fxpipe.codegen.builddir``); ``write_run_record`` then does not put
the old run's record into the new build but beside it, and says so, and ``fxpipe report``
never sets a run beside a plan of another build.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.errors import BuildDirError
from fxpipe.jsonio import check_schema_version, dump_json, load_json
from fxpipe.userfiles import shown
from fxpipe.schema import read_dataclass

if TYPE_CHECKING:
    from fxpipe.partitioner import PartitionPlan

__all__ = [
    "RunRecord",
    "RUN_RECORD_SCHEMA_VERSION",
    "read_build_plan",
    "build_sha256",
    "write_run_record",
]

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
    the steps done before; its ``step_seconds`` cover this run's steps only). ``build_sha256``:
    the build it ran (Note [a record names its build]). ``stopped``: why the run stopped before
    its last step (a NaN or infinite loss: ``losses`` end at the last finite one, ``step_seconds``
    include the step that diverged); ``None`` for a run that trained every step. A ``None`` loss or
    gradient norm is a step fp16's loss scaler skipped for its inf/NaN values. With ``--compile``,
    ``compile_seconds`` holds each stage's compile before the first step (stage order; empty
    without)."""

    losses: tuple[float | None, ...]
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
    grad_norms: tuple[float | None, ...] = ()
    eval_losses: tuple[tuple[int, float], ...] = ()
    first_step: int = 0
    build_sha256: str | None = None
    stopped: str | None = None
    compile_seconds: tuple[float, ...] = ()  # --compile: each stage's compile, in stage order
    schema_version: int = RUN_RECORD_SCHEMA_VERSION

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON data (sequences as lists)."""
        return {
            f.name: list(v) if isinstance(v := getattr(self, f.name), tuple) else v
            for f in fields(self)
        }

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
                why = (
                    f"its folder {shown(folder)} no longer exists (was it removed while the job ran?)"
                    if not folder.exists()
                    else exc.strerror or str(exc)
                )
                raise BuildDirError(
                    f"cannot write {shown(path)}: {why}; the run's record is lost"
                ) from None
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


def build_sha256(build_dir: str | Path) -> str | None:
    """The sha256 of ``build_dir``'s ``manifest.json`` (Note [a record names its build]); ``None``
    when it has none (or it is not a regular file: never read, it could block)."""
    path = Path(build_dir) / "manifest.json"
    try:
        if not path.is_file():
            return None
        return hashlib.sha256(path.read_bytes()).hexdigest()
    except OSError:
        return None


def _beside(build_dir: Path, sha: str) -> Path:
    """A new file beside ``build_dir`` for the record of a run of the build ``sha`` (never an existing one)."""
    for n in range(1000):
        path = build_dir.parent / f"{build_dir.name}.run-{sha[:12]}{f'-{n}' if n else ''}.json"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
            return path
        except FileExistsError:
            continue
    raise BuildDirError(f"cannot find a free name for this run's record beside {build_dir}")


def write_run_record(
    record: RunRecord, build_dir: str | Path, out: str | Path | None = None
) -> Path:
    """Write ``record`` whole (a temporary file, then a rename) to ``out``, by default
    ``build_dir/run.json``, and return where. When ``build_dir`` no longer holds the build the run
    loaded (``record.build_sha256``), the record goes to a new file beside it and a ``BuildDirError``
    says where (Note [a record names its build])."""
    from fxpipe.codegen.builddir import replace_file

    build_dir = Path(build_dir)
    text = record.to_json()
    if out is not None:
        replace_file(out, text + "\n")
        return Path(out)
    if record.build_sha256 is None or build_sha256(build_dir) == record.build_sha256:
        replace_file(build_dir / "run.json", text + "\n")
        return build_dir / "run.json"
    aside = _beside(build_dir, record.build_sha256)
    replace_file(aside, text + "\n")
    raise BuildDirError(
        f"the build directory {build_dir} was replaced while this run trained (its manifest.json "
        f"is not the one the run loaded: re-partitioned?), so this run's record was not written "
        f"into it, where it would describe another build; it is in {aside}"
    )
