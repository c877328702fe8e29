"""What a resumed ``fxpipe run`` carries over from its checkpoint, what changed, and what cannot continue.

Note [what a resume carries over]: every checkpoint of ``fxpipe run`` commits, in its record
(``checkpoint.json``'s ``meta``), the step it was saved after, the build it was saved from
(``build_identity``: the hashes of the model file and of every stage's code) and the settings
of the run (``run_settings``). ``check_resume`` compares them with the resuming run, in the
launching process before any worker starts (``fxpipe.runtime.launch.preflight``) and on every
rank before the first step (``fxpipe.runtime.train.loop``), and:

- refuses what cannot continue: another optimizer (its state does not fit: SGD's momentum is
  not Adam's moments), another model (a stage's code differs, or the model file whose classes
  a stage runs: the weights would load into a different function), a checkpoint already at or
  past ``--steps`` (nothing left to train);
- carries over the weights, the optimizer's state, the schedule's position, the RNG and the
  data position, and applies what the user changed (``apply_options``): the learning rate,
  weight decay and betas (``optimizer.load_state_dict`` would otherwise bring the saved ones
  back), the schedule and clipping; rank 0 prints both in ``ResumePlan.lines``.

A larger ``--steps`` stretches a ``linear`` or ``cosine`` schedule to end at the new last step
(its factor is a function of the step and the total: ``fxpipe.runtime.train.optim.lr_factor``):
the learning rate of the next step then differs from what the checkpoint's schedule gave, and
the resume says by how much. To keep the original decay, resume with the original ``--steps``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from fxpipe.errors import CheckpointError
from fxpipe.runtime.train.optim import lr_factor

if TYPE_CHECKING:
    from fxpipe.codegen.manifest import Manifest
    from fxpipe.runtime.pipeline.runner import PipelineRunner
    from fxpipe.runtime.train.run_options import RunOptions

__all__ = [
    "META_VERSION",
    "build_identity",
    "run_settings",
    "checkpoint_meta",
    "ResumePlan",
    "check_resume",
    "apply_options",
]

META_VERSION = 1

# the settings a resume compares, in the order it names them: (key, how a person reads it)
_SETTINGS = (
    ("lr", "lr"),
    ("steps", "steps"),
    ("weight_decay", "weight decay"),
    ("betas", "betas"),
    ("lr_schedule", "lr schedule"),
    ("warmup_steps", "warm-up steps"),
    ("clip_grad_norm", "clip grad norm"),
    ("precision", "precision"),
    ("batch_size", "batch"),
    ("microbatches", "microbatches"),
    ("backward_passes_per_step", "backward passes per step"),
    ("data", "data"),
)


def build_identity(manifest: Manifest, manifest_sha256: str | None) -> dict[str, Any]:
    """What names the model a checkpoint was trained as: the manifest's hash (the build), the model
    file's, and each stage's code (and whether it runs classes of the model file)."""
    return {
        "manifest_sha256": manifest_sha256,
        "model_file": manifest.model_file,
        "model_sha256": manifest.model_sha256,
        "model_fn": manifest.model_fn,
        "stage_sha256": [s.source_sha256 for s in manifest.stages],
        "imports_model_file": [s.imports_model_file for s in manifest.stages],
    }


def run_settings(options: RunOptions, batch_size: int, microbatches: int) -> dict[str, Any]:
    """The settings of a run that a resume compares (batch and microbatches resolved against the build)."""
    t = options.training
    return {
        "lr": options.lr,
        "steps": options.steps,
        "optimizer": t.optimizer,
        "weight_decay": t.weight_decay,
        "betas": list(t.betas),
        "lr_schedule": t.lr_schedule,
        "warmup_steps": t.warmup_steps,
        "clip_grad_norm": t.clip_grad_norm,
        "precision": options.precision,
        "batch_size": batch_size,
        "microbatches": microbatches,
        "backward_passes_per_step": options.data_parallel.backward_passes_per_step,
        "data": t.data,
    }


def checkpoint_meta(
    step: int, settings: dict[str, Any], identity: dict[str, Any]
) -> dict[str, Any]:
    """The ``meta`` a checkpoint after ``step`` commits (Note [what a resume carries over])."""
    return {"version": META_VERSION, "step": step, "build": identity, "settings": settings}


@dataclass(frozen=True)
class ResumePlan:
    """A resume that can go on: the step it continues after, what carries over, what changed."""

    step: int
    carried: str
    changes: tuple[str, ...] = ()

    def lines(self) -> list[str]:
        """What rank 0 prints before the first step."""
        out = [f"fxpipe run: resuming after step {self.step}: {self.carried} carry over"]
        if self.changes:
            out.append("fxpipe run: changed since the checkpoint: " + "; ".join(self.changes))
        return out


def _show(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, (list, tuple)):
        return ",".join(_show(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _lr_at(settings: dict[str, Any], step: int) -> float:
    """The learning rate a run with ``settings`` gives its step ``step + 1`` (0-based ``step``)."""
    passes = int(settings.get("backward_passes_per_step") or 1)
    return float(settings["lr"]) * lr_factor(
        step // passes,
        warmup_steps=int(settings.get("warmup_steps") or 0),
        total_steps=int(settings["steps"]) // passes,
        schedule=str(settings.get("lr_schedule") or "constant"),
    )


def _check_build(build: dict[str, Any], identity: dict[str, Any], where: str) -> str | None:
    """Refuse a checkpoint of another model; a note when only the model file's bytes changed."""
    remedy = (
        f"resume with the build it was saved from, or start a new run from its weights: fxpipe export "
        f"{where} --out weights.safetensors, then fxpipe partition MODEL --weights weights.safetensors, and "
        "run with another --checkpoint-dir"
    )
    old, new = build.get("stage_sha256"), identity["stage_sha256"]
    if old is not None and list(old) != list(new):
        if len(old) != len(new):
            differs = f"it has {len(old)} stages, this build {len(new)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(old, new)) if a != b)
            differs = f"stage {i}'s code differs"
        raise CheckpointError(
            f"--resume: the checkpoint in {where} was saved from another model ({differs}); its "
            f"weights would load into a different computation; {remedy}"
        )
    if build.get("model_sha256") and build["model_sha256"] != identity["model_sha256"]:
        runs = [i for i, flag in enumerate(identity["imports_model_file"]) if flag]
        if runs:
            raise CheckpointError(
                f"--resume: the model file changed since the checkpoint in {where} was saved, and "
                f"stage {runs[0]} runs classes from it; {remedy}"
            )
        return "the model file (the stages' code is the same)"
    return None


def check_resume(
    meta: dict[str, Any],
    step: int | None,
    options: RunOptions,
    batch_size: int,
    microbatches: int,
    identity: dict[str, Any],
    where: str,
) -> ResumePlan:
    """Compare the checkpoint's ``meta`` (``{}`` for a checkpoint of an older fxpipe; then ``step`` is
    its step, read from a part) with this run; raise ``CheckpointError`` for what cannot continue
    (Note [what a resume carries over])."""
    if meta.get("version", META_VERSION) > META_VERSION:
        raise CheckpointError(
            f"--resume: the checkpoint in {where} was written by a newer fxpipe; upgrade fxpipe"
        )
    step = int(meta.get("step", step if step is not None else 0))
    saved: dict[str, Any] = meta.get("settings") or {}
    now = run_settings(options, batch_size, microbatches)
    optimizer = saved.get("optimizer", now["optimizer"])
    if optimizer != now["optimizer"]:
        raise CheckpointError(
            f"--resume: the checkpoint in {where} holds {optimizer}'s optimizer state, and this run "
            f"asks for --optimizer {now['optimizer']}, which cannot continue from it; resume with "
            f"--optimizer {optimizer}, or start a new run with another --checkpoint-dir"
        )
    changed_model = _check_build(meta.get("build") or {}, identity, where)
    if step >= options.steps:
        past = (
            "nothing is left to train"
            if step == options.steps
            else f"--steps {options.steps} is before it"
        )
        raise CheckpointError(
            f"--resume: the checkpoint in {where} is after step {step} and {past}; give --steps "
            f"above {step} to train on"
        )
    changes = []
    for key, name in _SETTINGS:
        if (
            key in saved
            and saved[key] != now[key]
            and not (key == "betas" and now["optimizer"] == "sgd")
        ):
            note = f"{name} {_show(saved[key])} -> {_show(now[key])}"
            if key == "lr":
                note += f" (from step {step + 1})"
            changes.append(note)
    if saved.get("lr") is not None and saved.get("steps") is not None:
        before, after = _lr_at(saved, step), _lr_at(now, step)
        stretched = (
            saved["steps"] != now["steps"]
            and now["lr_schedule"] in ("linear", "cosine")
            and saved.get("lr_schedule") == now["lr_schedule"]
        )
        if stretched:
            changes.append(
                f"the {now['lr_schedule']} schedule is stretched to end at step {now['steps']} (it ended at "
                f"{saved['steps']}): step {step + 1} gets lr {after:.3g}, where the checkpoint's schedule "
                f"gave {before:.3g}"
            )
        elif before != after and saved.get("lr") == now["lr"]:
            changes.append(
                f"step {step + 1} gets lr {after:.3g}, where the checkpoint's schedule gave {before:.3g}"
            )
    if changed_model is not None:
        changes.append(changed_model)
    carried = f"the weights, the {optimizer} state, the schedule's position, the RNG and the data position"
    return ResumePlan(step=step, carried=carried, changes=tuple(changes))


def apply_options(runner: PipelineRunner, options: RunOptions) -> None:
    """Make a restored optimizer and scheduler follow this run's ``lr``, weight decay and betas
    (``load_state_dict`` brings back the checkpoint's). With unchanged options this sets the values
    the checkpoint holds, to the bit (``LambdaLR``'s own ``base_lr * factor(last_epoch)``)."""
    optimizer, scheduler = runner.optimizer, runner.scheduler
    if optimizer is None:
        return
    t = options.training
    for group in optimizer.param_groups:
        group["initial_lr"] = options.lr
        group["weight_decay"] = t.weight_decay
        if "betas" in group:
            group["betas"] = tuple(t.betas)
    lambdas = getattr(scheduler, "lr_lambdas", None)
    if scheduler is None or lambdas is None:
        for group in optimizer.param_groups:
            group["lr"] = options.lr
        return
    scheduler.base_lrs = [options.lr for _ in optimizer.param_groups]
    values = [base * fn(scheduler.last_epoch) for fn, base in zip(lambdas, scheduler.base_lrs)]
    for group, value in zip(optimizer.param_groups, values):
        group["lr"] = value
    scheduler._last_lr = list(values)  # what get_last_lr() reports
