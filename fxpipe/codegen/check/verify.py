"""``verify_build``: do the emitted stages, chained, compute what the original model computes?

The original model is rebuilt from the model file and given the build directory's
weights, so both sides start from identical values. Both run the model file's example
inputs at the manifest's batch size, in train mode and in eval mode, from the same seed
(:func:`fxpipe.codegen.check.equivalence.compare_in_mode`); the loss is the model file's
``loss_fn`` on ``example_targets`` when it has both, else a weighted sum of the floating
outputs. Outputs, every parameter's gradient and every buffer are compared, by the rule the
compiler's safety net uses (Note [one comparison rule] in :mod:`fxpipe.codegen.check.equivalence`).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

from fxpipe.codegen.check.equivalence import (
    ModeComparison,
    TensorError,
    compare_in_mode,
    probe_loss,
    rows_by_error,
)
from fxpipe.codegen.integrity import CheckedBuild, check_build
from fxpipe.codegen.load import read_manifest
from fxpipe.codegen.manifest import Manifest
from fxpipe.codegen.pipeline import load_checked_pipeline
from fxpipe.errors import BuildDirError
from fxpipe.modelfile import ModelSource

__all__ = ["VerifyReport", "TensorError", "verify_build", "print_verify_report"]


@dataclass(frozen=True)
class VerifyReport:
    """The chained stages against the original model, in each mode checked (train, then eval)."""

    modes: tuple[ModeComparison, ...]
    rtol: float
    atol: float
    loss: str

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.modes)

    def mode(self, training: bool) -> ModeComparison:
        return next(m for m in self.modes if m.training == training)

    @property
    def worst(self) -> TensorError | None:
        """The tensor furthest outside its tolerance (or, when all pass, furthest off)."""
        rows = rows_by_error([e for m in self.modes for e in m.rows])
        return rows[0] if rows else None

    def summary(self) -> str:
        """One line per mode, then the verdict."""
        lines = [m.summary() for m in self.modes]
        verdict = "OK" if self.ok else "MISMATCH"
        lines.append(
            f"{verdict}: the stages {'equal' if self.ok else 'differ from'} the model in "
            f"{' and '.join(m.mode for m in self.modes)} mode (per tensor, max abs error <= atol "
            f"{self.atol:g} + rtol {self.rtol:g} x its largest magnitude; loss {self.loss})"
        )
        return "\n".join(lines)


def _checked_build(build_dir: Path) -> tuple[CheckedBuild, ModelSource]:
    """Every file of the build checked against its manifest (Note [check before use] in
    ``fxpipe.codegen.integrity``), and the model file imported from its checked bytes."""
    manifest = read_manifest(build_dir)
    if not manifest.model_file:
        raise BuildDirError(
            f"{build_dir} records no model file, so there is no original model to compare with"
        )
    if manifest.weights == "init":
        raise BuildDirError(
            f"{build_dir} was built on the meta device without --weights: each stage initialises "
            "itself at load, so there are no weights to give the model; verify a build made with "
            "--weights CHECKPOINT"
        )
    build = check_build(build_dir, plan=False, manifest=manifest)
    return build, build.model_source()


def _load_reference(build: CheckedBuild, source: ModelSource) -> nn.Module:
    model = source.build_model()
    state = model.state_dict(keep_vars=True)
    for sm in build.manifest.stages:
        for key, value in build.load_weights(sm.index).items():
            if key in state:
                with torch.no_grad():
                    state[key].copy_(value)
            else:  # a non-persistent buffer
                owner, _, name = key.rpartition(".")
                try:
                    buffer = model.get_submodule(owner)._buffers.get(name)
                except AttributeError:
                    buffer = None
                if buffer is not None:
                    with torch.no_grad():
                        buffer.copy_(value)
    return model


def _loss(source: Any, batch_size: int) -> tuple[Callable[[Any], torch.Tensor | None], str]:
    """The model file's ``loss_fn`` on its ``example_targets`` when it has both, else the probe loss."""
    if not (source.has(source.loss_fn_name) and source.has(source.targets_fn)):
        return probe_loss, "weighted sum of the outputs"
    targets = source.example_targets(batch_size)

    def loss(output: Any) -> torch.Tensor | None:
        try:
            return source.loss_fn(output, targets)
        except Exception as exc:  # e.g. a model file whose loss_fn is for another of its models
            warnings.warn(
                f"{source.loss_fn_name}() failed on this model's output ({type(exc).__name__}: {exc}); "
                "verifying gradients of a weighted sum of the outputs instead",
                stacklevel=2,
            )
            return probe_loss(output)

    return loss, f"{source.loss_fn_name}()"


def verify_build(
    build_dir: str | Path,
    rtol: float = 1e-4,
    atol: float = 1e-5,
    prepare: Callable[[Manifest, list[nn.Module]], None] | None = None,
) -> VerifyReport:
    """Compare the chained stages of ``build_dir`` with the original model; see the module docstring.
    ``prepare(manifest, stages)`` runs on the loaded stages first (``fxpipe verify --compile``
    compiles them: ``fxpipe.runtime.pipeline.compiled_verify``).

    Example::

        report = verify_build("build")
        print(report.summary()); assert report.ok
    """
    build, source = _checked_build(Path(build_dir))
    manifest = build.manifest
    reference = _load_reference(build, source)
    pipeline = load_checked_pipeline(build)
    if prepare is not None:
        prepare(manifest, list(pipeline.stages))
    # a static build (Note [a batch the model fixes]) takes one microbatch at a time
    batch = manifest.microbatch_size if manifest.static_batch else manifest.batch_size
    call = source.example_call(batch)
    loss, loss_name = _loss(source, batch)
    modes = tuple(
        compare_in_mode(
            reference,
            pipeline,
            list(pipeline.stages),
            call,
            training=training,
            loss=loss,
            rtol=rtol,
            atol=atol,
        )
        for training in (True, False)
    )
    return VerifyReport(modes=modes, rtol=rtol, atol=atol, loss=loss_name)


def print_verify_report(
    report: VerifyReport, console: Any = None, *, all_rows: bool = False, shown: int = 8
) -> None:
    """Print, per mode, the ``shown`` tensors furthest off (failing first; every tensor with ``all_rows``),
    then one summary line per mode and the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    for m in report.modes:
        rows = m.rows if all_rows else rows_by_error(m.rows)[:shown]
        what = (
            "every tensor" if all_rows else f"the {len(rows)} of {len(m.rows)} tensors furthest off"
        )
        table = Table(title=f"{m.mode} mode: {what} (loss: {report.loss})", title_justify="left")
        for column in ("tensor", "max abs error", "allowed", "error / max |value|", ""):
            table.add_column(column, justify="left" if column == "tensor" else "right")
        for e in rows:  # the verdict is max abs error <= allowed (Note [one comparison rule])
            table.add_row(
                e.name,
                f"{e.max_abs:.3g}",
                f"{e.allowed:.3g}",
                f"{e.max_rel:.3g}",
                "[green]ok[/]" if e.ok else "[red]MISMATCH[/]",
            )
        console.print(table)
    for line in report.summary().splitlines():
        console.print(("[green]" if report.ok else "[red]") + line + "[/]")
