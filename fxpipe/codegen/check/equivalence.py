"""Is a pipeline the model? One seeded forward and backward of each in one mode, tensor by tensor.

Shared by ``fxpipe verify`` (:mod:`fxpipe.codegen.check.verify`) and the compiler's safety net
(:mod:`fxpipe.codegen.check.safety`). Both sides run the same inputs from the same RNG seed, in
the same mode (``train()`` or ``eval()``); their outputs, the gradient of every parameter
(by the original model's keys, tied parameters found through any of their names) and
every buffer after the forward (batch-norm statistics move in train mode) are compared.
A frozen parameter (``requires_grad=False``) has no gradient on either side; one frozen on one
side only is a failing row ``requires_grad KEY`` (Note [frozen parameters] in
:mod:`fxpipe.codegen.graph.ownership`).
The reference model is left as it was: its modes, buffers and ``.grad`` are untouched
(gradients come from ``torch.autograd.grad``), and so is the caller's RNG state.

Note [one comparison rule]: a tensor of the pipeline equals the model's when its largest
absolute difference is within ``atol + rtol * max |model's tensor|``: the error is measured
against the tensor's own scale, not element by element. Float32 sums in another order (a
stage boundary, a gradient accumulated in another order) leave an error of about machine
epsilon times the magnitude of the terms summed, which is the tensor's scale, so a near-zero
element of a large gradient carries the same absolute noise as its largest one; an
element-wise rule flagged such noise (6e-5 on a gradient of magnitude 370, a relative error
of 1.6e-7). The safety net and ``fxpipe verify`` both decide with :func:`compare_tensor`, and
``fxpipe verify`` prints the two sides of this inequality (max abs error, allowed).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn
from torch.utils._pytree import tree_leaves

from fxpipe.tracer.seeding import seeded
from fxpipe.tracer.train_eval.modes import modes_restored

__all__ = [
    "TensorError",
    "ModeComparison",
    "compare_tensor",
    "compare_in_mode",
    "probe_loss",
    "mode_name",
    "rows_by_error",
    "state_kept",
    "Run",
    "RTOL",
    "ATOL",
]

RTOL = 1e-4
ATOL = 1e-5
Loss = Callable[[Any], "torch.Tensor | None"]
Run = Callable[
    [nn.Module], Any
]  # calls a model (or pipeline) on the example inputs, returns its output


@dataclass(frozen=True)
class TensorError:
    """How far one pipeline tensor is from the original: its max abs error, that error relative to the model
    tensor's largest magnitude, and whether it is within ``allowed`` (Note [one comparison rule])."""

    name: str
    max_abs: float
    max_rel: float
    ok: bool
    allowed: float = 0.0  # atol + rtol * max |model's tensor|; ok == (max_abs <= allowed)


@dataclass(frozen=True)
class ModeComparison:
    """The pipeline against the model in one mode: outputs, parameter gradients, buffers after the forward."""

    training: bool
    outputs: tuple[TensorError, ...]
    grads: tuple[TensorError, ...]
    buffers: tuple[TensorError, ...] = ()

    @property
    def mode(self) -> str:
        return mode_name(self.training)

    @property
    def rows(self) -> tuple[TensorError, ...]:
        return self.outputs + self.grads + self.buffers

    @property
    def ok(self) -> bool:
        return all(e.ok for e in self.rows)

    @property
    def failing(self) -> tuple[TensorError, ...]:
        return tuple(e for e in self.rows if not e.ok)

    @property
    def worst(self) -> TensorError | None:
        """The first failing tensor furthest off, else the tensor with the largest error."""
        return max(self.failing or self.rows, key=lambda e: e.max_abs, default=None)

    def summary(self) -> str:
        def most(rows: tuple[TensorError, ...]) -> str:
            return f"max abs {max((e.max_abs for e in rows), default=0.0):.3g}"

        status = "OK" if self.ok else f"MISMATCH ({len(self.failing)} of {len(self.rows)} tensors)"
        return (
            f"{self.mode} mode {status}: {len(self.outputs)} outputs {most(self.outputs)}; {len(self.grads)} "
            f"parameter gradients {most(self.grads)}; {len(self.buffers)} buffers {most(self.buffers)}"
        )


def mode_name(training: bool) -> str:
    return "train" if training else "eval"


def rows_by_error(rows: Sequence[TensorError]) -> list[TensorError]:
    """Failing tensors first, each group furthest off first."""
    return sorted(rows, key=lambda e: (e.ok, -e.max_abs if math.isfinite(e.max_abs) else -math.inf))


def compare_tensor(
    name: str, got: Any, want: Any, rtol: float = RTOL, atol: float = ATOL
) -> TensorError:
    """One tensor of the pipeline against the model's (Note [one comparison rule]); a missing gradient counts
    as zeros, NaN equals NaN."""
    if got is None or want is None:
        other = want if got is None else got
        ok = other is None or (isinstance(other, torch.Tensor) and not bool(other.detach().any()))
        err = 0.0 if ok else math.inf
        return TensorError(name, err, err, ok, atol)
    if not isinstance(got, torch.Tensor) or not isinstance(want, torch.Tensor):
        same = type(got) is type(want) and got == want
        return TensorError(name, 0.0 if same else math.inf, 0.0 if same else math.inf, bool(same))
    if got.shape != want.shape:
        return TensorError(name, math.inf, math.inf, False)
    if not want.is_floating_point() and not want.is_complex():
        same = bool(torch.equal(got.detach().cpu(), want.detach().cpu()))
        return TensorError(name, 0.0 if same else math.inf, 0.0 if same else math.inf, same)
    if want.numel() == 0 or (
        got.dtype == want.dtype and got.device == want.device and torch.equal(got, want)
    ):
        w = want.detach()
        scale = float(torch.where(torch.isfinite(w), w.abs(), 0.0).max()) if w.numel() else 0.0
        return TensorError(
            name, 0.0, 0.0, True, atol + rtol * scale
        )  # the usual case, in one cheap pass
    dtype = torch.promote_types(
        want.dtype, torch.float32
    )  # exact enough, and half the memory of float64
    g, w = got.detach().to(want.device, dtype), want.detach().to(dtype)
    same = (torch.isnan(g) & torch.isnan(w)) | (g == w)  # equal infinities too
    diff = torch.where(same, 0.0, (g - w).abs().nan_to_num(nan=math.inf, posinf=math.inf))
    max_abs = float(diff.max())
    scale = float(torch.where(torch.isfinite(w), w.abs(), 0.0).max())
    allowed = atol + rtol * scale
    return TensorError(
        name, max_abs, max_abs / scale if scale > 0 else max_abs, max_abs <= allowed, allowed
    )


def probe_loss(output: Any) -> torch.Tensor | None:
    """A scalar that every floating output element moves: each output times fixed random weights, summed
    (a plain sum would miss errors that keep the sum, e.g. in a softmax). None without a floating output."""
    floats = [
        t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    if not floats:
        return None
    gen = torch.Generator().manual_seed(1234)
    terms = [(t.float() * torch.randn(t.shape, generator=gen).to(t.device)).sum() for t in floats]
    return torch.stack(terms).sum()


@contextlib.contextmanager
def state_kept(model: nn.Module) -> Iterator[None]:
    """Put the model's modes (``train()``/``eval()``) and buffers back as they were after the block."""
    saved = [(b, b.detach().clone()) for b in model.buffers()]
    try:
        with modes_restored(model):
            yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


@dataclass(frozen=True)
class _Run:
    outputs: list[Any]
    grads: dict[str, torch.Tensor | None]
    buffers: dict[str, torch.Tensor]
    frozen: frozenset[str] = frozenset()  # keys of parameters with requires_grad=False


def _named_tensors(
    modules: Sequence[nn.Module],
) -> tuple[dict[str, nn.Parameter], dict[str, torch.Tensor]]:
    params: dict[str, nn.Parameter] = {}
    buffers: dict[str, torch.Tensor] = {}
    for m in modules:
        params.update(m.named_parameters(remove_duplicate=False))
        buffers.update(m.named_buffers(remove_duplicate=False))
    return params, buffers


def _run(
    model: nn.Module,
    parts: Sequence[nn.Module],
    run: Run,
    loss: Loss,
    seed: int,
    devices: list[torch.device],
) -> _Run:
    params, buffers = _named_tensors(parts)
    with seeded(seed, devices), torch.enable_grad():  # Note [one random state for both sides]
        output = run(model)
        value = loss(output)
        unique = list({id(p): p for p in params.values() if p.requires_grad}.values())
        grads_by_id: dict[int, torch.Tensor | None] = {}
        if value is not None and value.requires_grad and unique:
            for p, g in zip(unique, torch.autograd.grad(value, unique, allow_unused=True)):
                grads_by_id[id(p)] = g
    return _Run(
        outputs=tree_leaves(output),
        grads={k: grads_by_id.get(id(p)) for k, p in params.items()},
        buffers={k: b.detach().clone() for k, b in buffers.items()},
        frozen=frozenset(k for k, p in params.items() if not p.requires_grad),
    )


def compare_in_mode(
    reference: nn.Module,
    pipeline: nn.Module,
    stages: Sequence[nn.Module],
    run: Run,
    *,
    training: bool,
    loss: Loss = probe_loss,
    rtol: float = RTOL,
    atol: float = ATOL,
    seed: int = 0,
) -> ModeComparison:
    """Run ``reference`` and ``pipeline`` (whose parameters live in ``stages``, under the reference's keys) in
    one mode from the same seed, each as ``run(model)`` does (the example call); compare outputs, parameter
    gradients and buffers (see the module docstring)."""
    devices = sorted(
        {
            t.device
            for t in list(reference.parameters()) + list(reference.buffers())
            if t.device.type == "cuda"
        },
        key=str,
    )
    with state_kept(reference), state_kept(pipeline):
        reference.train(training)
        pipeline.train(training)
        want = _run(reference, [reference], run, loss, seed, devices)
        got = _run(pipeline, stages, run, loss, seed, devices)
    outputs = [
        compare_tensor(f"output[{i}]", g, w, rtol, atol)
        for i, (g, w) in enumerate(zip(got.outputs, want.outputs))
    ]
    if len(got.outputs) != len(want.outputs):
        outputs.append(
            TensorError(
                f"output count ({len(got.outputs)} vs {len(want.outputs)})",
                math.inf,
                math.inf,
                False,
            )
        )
    aliases: dict[int, list[str]] = {}
    for key, p in reference.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(p), []).append(key)
    grads = []
    for key, p in reference.named_parameters():
        held = next((k for k in aliases[id(p)] if k in got.grads), None)
        if held is not None and (held in got.frozen) != (key in want.frozen):
            # a frozen parameter made trainable (or the reverse) is wrong even where its gradient is zero
            grads.append(TensorError(f"requires_grad {key}", math.inf, math.inf, False))
            continue
        grads.append(
            compare_tensor(
                f"grad {key}",
                None if held is None else got.grads[held],
                want.grads.get(key),
                rtol,
                atol,
            )
        )
    buffers = [
        compare_tensor(f"buffer {key}", got.buffers[key], value, rtol, atol)
        for key, value in want.buffers.items()
        if key in got.buffers
    ]
    return ModeComparison(
        training=training, outputs=tuple(outputs), grads=tuple(grads), buffers=tuple(buffers)
    )
