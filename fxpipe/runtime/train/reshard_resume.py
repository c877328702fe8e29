"""What a resume from a model-keyed checkpoint carries into another layout, and what stops it.

Note [resuming into another layout]: a checkpoint of the model-keyed format (Note [checkpoints
keyed by the model] in ``fxpipe.runtime.train.dcp_checkpoint``) resumes any build partitioned
from the same model file: other ``--stages``, ``--virtual-stages``, ``--schedule``, ``--dp``,
``--shard`` or ``--microbatches``. ``fxpipe run NEW_BUILD --resume-from D`` reads it (``--resume``
reads ``--checkpoint-dir`` the same way when it holds one). Before any step, in the launching
process (``fxpipe.runtime.launch.preflight``) and on every rank, ``check_layout_resume`` refuses
what cannot continue with one line naming it:

- another global batch (samples per step: batch x replicas): the data position is kept in
  samples, and a different number per step would be another trajectory;
- another optimizer, a checkpoint at or past ``--steps``: as for ``--resume`` (Note [what a
  resume carries over] in ``fxpipe.runtime.train.resume``);
- another model: when the model file (its sha256) and the function building the model in it
  are those the checkpoint was trained from, any layout of it resumes (another layout has other
  stages, whose code cannot be compared); when either changed, every stage's code must be the
  checkpoint's, as for ``--resume``. The keys and shapes of the model are compared too, on the
  ranks, against the checkpoint's metadata (``check_dcp_keys``);

and reports, beside what ``check_resume`` reports (a changed ``--lr`` included), the layout it
came from. The data position carries over in samples: the run continues at sample
``samples``, i.e. step ``samples / global batch``, whatever the replica count; each replica
then draws its share of that step's global batch as it would have in one run. The RNG streams
carry over per stage (Note [RNG streams by stage] in ``fxpipe.runtime.train.dcp_checkpoint``):
a rank continues the streams of the saving rank that held its stages with the same replicas,
microbatches (and schedule, for several stages per rank); the resume names the stages whose
streams start afresh.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fxpipe.errors import CheckpointError
from fxpipe.runtime.train.commit import CommitRecord, read_record
from fxpipe.runtime.train.dcp_checkpoint import RECORD_NAME, describe_layout, is_dcp
from fxpipe.runtime.train.resume import ResumePlan, check_resume

if TYPE_CHECKING:
    from fxpipe.runtime.train.run_options import RunOptions

__all__ = ["resume_record", "check_layout_resume", "layout_note"]


def resume_record(directory: str | Path) -> CommitRecord:
    """The committed model-keyed checkpoint that ``--resume-from directory`` names."""
    flag = f"--resume-from {str(directory)!r}"
    if not Path(directory).is_dir():
        raise CheckpointError(
            f"{flag} is not a directory; name a --checkpoint-dir of an earlier run"
        )
    record = read_record(Path(directory) / RECORD_NAME)
    if record is None:
        raise CheckpointError(
            f"{flag} holds no checkpoint (it has no {RECORD_NAME}); name the --checkpoint-dir of an "
            "earlier run"
        )
    if not is_dcp(dict(record.meta)):
        raise CheckpointError(
            f"{flag} holds per-rank files of an older fxpipe, which only the layout that wrote "
            f"them reads: resume it with that build and --checkpoint-dir {directory} --resume: its "
            "next checkpoint is model-keyed"
        )
    return record


def check_layout_resume(
    meta: dict[str, Any],
    options: RunOptions,
    batch: int,
    microbatches: int,
    replicas: int,
    identity: dict[str, Any],
    where: str,
    flag: str = "--resume-from",
) -> ResumePlan:
    """Refuse what a model-keyed checkpoint cannot continue into this run (Note [resuming into
    another layout]); the plan of what carries over and what changed otherwise."""
    saved = meta.get("settings") or {}
    layout = meta.get("layout") or {}
    before = int(saved.get("batch_size", batch)) * int(layout.get("replicas", 1))
    now = batch * replicas
    if before != now:
        raise CheckpointError(
            f"{flag}: the checkpoint in {where} trained on {before} samples per step "
            f"(batch {saved.get('batch_size')} x {layout.get('replicas', 1)} replicas), this run on "
            f"{now} (batch {batch} x {replicas}); give --batch-size {before // replicas} so the "
            "global batch stays the same"
        )
    build = dict(meta.get("build") or {})
    same_model = build.get("model_sha256") == identity.get("model_sha256") and build.get(
        "model_fn", identity.get("model_fn")
    ) == identity.get("model_fn")
    if same_model:  # the same model file and function: any layout of it (else every stage's code)
        build.pop("stage_sha256", None)
    try:
        plan = check_resume(
            {**meta, "build": build}, None, options, batch, microbatches, identity, where
        )
    except CheckpointError as exc:
        raise CheckpointError(str(exc).replace("--resume:", f"{flag}:", 1)) from None
    samples = int(meta.get("samples", plan.step * now))
    if samples != plan.step * now:
        raise CheckpointError(
            f"{flag}: the checkpoint in {where} is after {samples} samples, not a whole number of "
            f"steps of {now}; resume with the global batch it was trained with"
        )
    return plan


def layout_note(
    plan: ResumePlan, saved: dict[str, Any], now: dict[str, Any], lost: Sequence[str]
) -> ResumePlan:
    """``plan`` with the layout change said, and the stages whose RNG streams start afresh
    (``lost``; Note [RNG streams by stage] in ``fxpipe.runtime.train.dcp_checkpoint``)."""
    changes = list(plan.changes)
    if saved and saved != now:
        changes.insert(0, f"layout {describe_layout(saved)} -> {describe_layout(now)}")
    if not lost:
        return replace(plan, changes=tuple(changes))
    changes.append(
        f"the RNG streams of the ranks holding {'; '.join(lost)} are not carried over (no rank of "
        "the checkpoint held the same stages with the same replicas, microbatches and schedule): "
        "they start their own"
    )
    carried = plan.carried.replace(
        "the RNG and the data position", "the data position (in samples)"
    )
    return replace(plan, changes=tuple(changes), carried=carried)
