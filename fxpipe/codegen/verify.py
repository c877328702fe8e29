"""``verify_build``: do the emitted stages, chained, compute what the original model computes?

The original model is rebuilt from the model file and given the build directory's
weights, so both sides start from identical values. Both run the model file's example
inputs at the manifest's batch size in the mode the model was traced in; the loss is
the model file's ``loss_fn`` on ``example_targets`` when it has both, else the sum of
the floating outputs. Outputs and every parameter's gradient are compared.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from fxpipe.codegen.integrity import CheckedBuild, check_build
from fxpipe.codegen.load import load_checked_pipeline, read_manifest
from fxpipe.errors import BuildDirError, ModelFileError
from fxpipe.modelfile import ModelSource

__all__ = ["VerifyReport", "TensorError", "verify_build", "print_verify_report"]


@dataclass(frozen=True)
class TensorError:
    """How far one pipeline tensor is from the original: max abs and relative error, and whether it is within tolerance."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool


@dataclass(frozen=True)
class VerifyReport:
    """Errors of the chained stages against the original model (outputs, then parameter gradients)."""

    outputs: tuple[TensorError, ...]
    grads: tuple[TensorError, ...]
    rtol: float
    atol: float
    loss: str

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.outputs + self.grads)

    @property
    def max_abs_output(self) -> float:
        return max((e.max_abs for e in self.outputs), default=0.0)

    @property
    def max_rel_output(self) -> float:
        return max((e.max_rel for e in self.outputs), default=0.0)

    @property
    def max_abs_grad(self) -> float:
        return max((e.max_abs for e in self.grads), default=0.0)

    @property
    def max_rel_grad(self) -> float:
        return max((e.max_rel for e in self.grads), default=0.0)

    @property
    def worst(self) -> TensorError | None:
        """The tensor furthest outside (or closest to) its tolerance."""
        bad = [e for e in self.outputs + self.grads if not e.ok]
        return max(bad or list(self.outputs + self.grads), key=lambda e: e.max_abs, default=None)

    def summary(self) -> str:
        status = "OK" if self.ok else "MISMATCH"
        return (f"{status}: outputs max abs {self.max_abs_output:.3g} rel {self.max_rel_output:.3g}; "
                f"{len(self.grads)} parameter gradients max abs {self.max_abs_grad:.3g} rel {self.max_rel_grad:.3g} "
                f"(rtol {self.rtol:g}, atol {self.atol:g}, loss {self.loss})")


def _compare(name: str, got: torch.Tensor | None, want: torch.Tensor | None, rtol: float, atol: float) -> TensorError:
    if got is None or want is None:
        same = got is None and want is None
        return TensorError(name, 0.0 if same else float("inf"), 0.0 if same else float("inf"), same)
    if got.shape != want.shape:
        return TensorError(name, float("inf"), float("inf"), False)
    g, w = got.detach().double().cpu(), want.detach().double().cpu()
    diff = (g - w).abs()
    max_abs = float(diff.max()) if diff.numel() else 0.0
    scale = float(w.abs().max()) if w.numel() else 0.0
    ok = bool(torch.all(diff <= atol + rtol * w.abs())) if diff.numel() else True
    return TensorError(name, max_abs, max_abs / scale if scale > 0 else max_abs, ok)


def _checked_build(build_dir: Path) -> tuple[CheckedBuild, ModelSource]:
    """Every file of the build checked against its manifest (Note [check before use] in
    ``fxpipe.codegen.integrity``), and the model file imported from its checked bytes."""
    manifest = read_manifest(build_dir)
    if not manifest.model_file:
        raise BuildDirError(f"{build_dir} records no model file, so there is no original model to compare with")
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


def _loss(output: Any, source: Any, batch_size: int) -> tuple[torch.Tensor, str]:
    if source.has(source.loss_fn_name) and source.has(source.targets_fn):
        try:
            return source.loss_fn(output, source.example_targets(batch_size)), f"{source.loss_fn_name}()"
        except Exception as exc:  # e.g. a model file whose loss_fn is for another of its models
            warnings.warn(f"{source.loss_fn_name}() failed on this model's output ({type(exc).__name__}: {exc}); "
                          "verifying gradients of the sum of the outputs instead", stacklevel=3)
    floats = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not floats:
        raise ModelFileError(
            f"the model's outputs hold no floating-point tensor, so verify has nothing to differentiate; "
            f"define {source.loss_fn_name}() and {source.targets_fn}() in {source.path.name} to verify gradients")
    return sum((t.sum() for t in floats[1:]), floats[0].sum()), "sum of outputs"


def verify_build(build_dir: str | Path, rtol: float = 1e-4, atol: float = 1e-5) -> VerifyReport:
    """Compare the chained stages of ``build_dir`` with the original model; see the module docstring.

    Example::

        report = verify_build("build")
        print(report.summary()); assert report.ok
    """
    build, source = _checked_build(Path(build_dir))
    manifest = build.manifest
    training = manifest.training
    reference = _load_reference(build, source).train(training)
    pipeline = load_checked_pipeline(build).train(training)
    inputs = source.example_inputs(manifest.batch_size)

    results = []
    for model in (reference, pipeline):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            output = model(*inputs)
            loss, loss_name = _loss(output, source, manifest.batch_size)
            loss.backward()
        results.append(output)
    want, got = (tree_leaves(r) for r in results)
    outputs = tuple(_compare(f"output[{i}]", g, w, rtol, atol) for i, (g, w) in enumerate(zip(got, want)))
    if len(got) != len(want):
        outputs += (TensorError("output count", float("inf"), float("inf"), False),)

    pipe_params: dict[str, nn.Parameter] = {}
    for stage in pipeline.stages:
        pipe_params.update(stage.named_parameters(remove_duplicate=False))
    by_id: dict[int, list[str]] = {}
    for key, p in reference.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), []).append(key)
    grads = []
    for key, p in reference.named_parameters():
        held = next((pipe_params[k] for k in by_id[id(p)] if k in pipe_params), None)
        if held is None:  # not used by the traced graph: the original gets no gradient either
            grads.append(_compare(f"grad {key}", None, p.grad, rtol, atol))
        else:
            grads.append(_compare(f"grad {key}", held.grad, p.grad, rtol, atol))
    return VerifyReport(outputs=outputs, grads=tuple(grads), rtol=rtol, atol=atol, loss=loss_name)


def print_verify_report(report: VerifyReport, console: Any = None) -> None:
    """Print every output and parameter gradient with its error, then the verdict."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    table = Table(title=f"pipeline vs original model (loss: {report.loss})", title_justify="left")
    for column in ("tensor", "max abs error", "max rel error", ""):
        table.add_column(column, justify="left" if column == "tensor" else "right")
    for e in report.outputs + report.grads:
        table.add_row(e.name, f"{e.max_abs:.3g}", f"{e.max_rel:.3g}", "[green]ok[/]" if e.ok else "[red]MISMATCH[/]")
    console.print(table)
    console.print(("[green]" if report.ok else "[red]") + report.summary() + "[/]")
