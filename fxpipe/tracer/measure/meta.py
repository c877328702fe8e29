"""Tracing on the meta device: models larger than the machine, profiled without a real tensor.

Note [meta tracing]: with ``trace_device="meta"`` (CLI ``--device meta``) the model is built
under ``torch.device("meta")`` (:func:`build_on_meta`; a model file whose factory already
builds on meta is detected by :func:`is_meta_model`), its example inputs are moved to meta,
and every step of :func:`fxpipe.tracer.trace_model` that only needs shapes runs as it does on
real tensors: the front ends trace, shape propagation runs the graph on meta tensors,
``FlopCounterMode`` counts FLOPs from shapes, ``saved_tensors_hooks`` sees the tensors
autograd saves (their storages are told apart by identity, :func:`storage_key`, as meta
storages have no address), and the dispatch mode counts aten ops. Unit times are the analytic
estimate of the cost device (``cost_device``, default ``"cpu"``), so a meta profile equals the
real-tensor analytic profile of the same model (tests/tracer/test_meta_trace.py).
The model's own (eager) runs go through ``FakeTensorMode`` (:func:`eager_mode`): libraries
that check input values in Python only when not tracing (transformers' mask preprocessing
asks ``is_fake_tensor``) then take their tracing path, as under ``torch.export``.

What needs values cannot run and is skipped, and the profile says so
(``ModelProfile.skipped_checks``, :data:`SKIPPED_ON_META`): the check that the traced graph
reproduces the model's outputs (train and eval mode), and later codegen's safety net
(:mod:`fxpipe.codegen.check.safety`). Measuring times or memory needs real kernels:
``measure_times`` / ``measure_memory`` on meta is a :class:`~fxpipe.errors.TraceError`.
A model with data-dependent control flow (``.item()``, ``nonzero``) or an op whose meta kernel
refuses it cannot be traced on meta either; the error names the op and the module and says
to trace on ``cpu`` instead (Note [ops that need values]).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Iterator, TypeVar

import torch
import torch.fx
import torch.nn as nn
from torch.overrides import TorchFunctionMode


from fxpipe.errors import TraceError

__all__ = [
    "META",
    "SKIPPED_ON_META",
    "build_on_meta",
    "is_meta_model",
    "check_meta_options",
    "move_to_meta",
    "storage_key",
    "eager_mode",
    "cost_device_kernels",
    "CpuKernelChoice",
]

META = "meta"

SKIPPED_ON_META: tuple[str, ...] = (
    "traced graph vs the model's own outputs (train and eval mode): meta tensors hold no values",
)

_M = TypeVar("_M")


def build_on_meta(factory: Callable[[], _M]) -> _M:
    """``factory()`` with every parameter on the meta device: no memory and no time spent on initial values.

    Note [parameters on meta, buffers real]: only parameters go to meta (``nn.Parameter`` turns
    the tensor it wraps into a meta tensor of the same shape, while the factory runs); buffers
    are built as the factory builds them, so the values that no checkpoint holds (rotary
    frequencies, causal masks: non-persistent buffers) stay known and a build can write them.
    A parameter's tensor is allocated before it is wrapped (``torch.empty``: address space,
    no pages touched) and freed at once; a factory that computes big initial values before
    wrapping them (``nn.Parameter(torch.randn(V, D))``) still computes them, one at a time.
    A factory that builds on meta by itself (``with torch.device("meta")``) keeps its meta buffers.
    """
    saved = nn.Parameter.__dict__["__new__"]
    original = nn.Parameter.__new__

    def meta_parameter(
        cls: type, data: torch.Tensor | None = None, requires_grad: bool = True
    ) -> Any:
        if isinstance(data, torch.Tensor) and not data.is_meta:
            data = data.to(META)
        return original(cls, data, requires_grad)

    type.__setattr__(nn.Parameter, "__new__", staticmethod(meta_parameter))
    try:
        return factory()
    finally:
        type.__setattr__(nn.Parameter, "__new__", saved)


def is_meta_model(model: nn.Module) -> bool:
    """Whether the model's parameters live on the meta device (its factory built it there)."""
    params = list(model.parameters())
    return bool(params) and all(p.is_meta for p in params)


def check_meta_options(model: nn.Module, measure_times: bool, measure_memory: bool) -> None:
    """Refuse what a meta trace cannot do (Note [meta tracing])."""
    if measure_times or measure_memory:
        what = "--measure-times" if measure_times else "--measure-memory"
        raise TraceError(
            f"{what} runs real kernels, but the trace device is meta (no tensor has values); "
            "drop it (meta profiles use the analytic estimate) or trace on cpu/cuda"
        )
    real = [name for name, p in model.named_parameters() if not p.is_meta]
    if real:
        raise TraceError(
            f"trace_device 'meta' needs a model built on the meta device, but {len(real)} parameters "
            f"hold real values ({real[:3]}); build it under `with torch.device('meta'):` "
            "(fxpipe does for a model file), or trace on cpu"
        )


def move_to_meta(model: nn.Module) -> dict[str, torch.Tensor]:
    """Move the model's real buffers to meta, in place; return their values by key (Note [parameters on
    meta, buffers real]: a build writes them, since a checkpoint need not hold them)."""
    values = {key: b for key, b in model.named_buffers(remove_duplicate=False) if not b.is_meta}
    if values:
        model.to(META)
    return values


def storage_key(t: torch.Tensor) -> int:
    """A key that tells storages apart: the data address, or on meta (no address) the storage's identity."""
    storage = t.untyped_storage()
    return storage._cdata if t.is_meta else storage.data_ptr()


def eager_mode(on_meta: bool) -> ContextManager[Any]:
    """The context for running the model itself (not its graph) during a trace: on meta, a
    ``FakeTensorMode`` that takes the meta parameters as they are (Note [meta tracing]); an op
    that cannot run there is one :class:`~fxpipe.errors.TraceError` (Note [ops that need values])."""
    if not on_meta:
        return contextlib.nullcontext()
    return _fake_run()


@contextlib.contextmanager
def _fake_run() -> Iterator[None]:
    """Note [ops that need values]: some models read tensor values outside tracing, or call a kernel
    whose meta implementation refuses what the CPU accepts: transformers' MoE routing
    (``torch.where``/``nonzero`` per expert: data-dependent shapes), ``.item()``, or Mixtral's
    ``torch._grouped_mm``, whose meta kernel takes bfloat16 only. Such a model cannot be planned
    analytically. When the model's run on fake tensors raises from inside an aten op, the
    traceback names the op (the fake mode's ``func``) and the module (the innermost ``forward``'s
    ``self``), and the failure becomes one line naming both and saying to trace with real
    tensors. Nothing is tracked while the model runs: a run that succeeds pays nothing."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode(allow_non_fake_inputs=True):
            yield
    except Exception as exc:
        found = _failed_op(exc)
        if found is None:
            raise
        op, where, error = found
        raise TraceError(
            f"on the meta device, {op} in {where} cannot run ({error}): the model reads tensor values "
            "or calls a kernel the meta device lacks, so it cannot be planned analytically; trace with "
            "real tensors (--device cpu, or --device cuda)"
        ) from exc


def _failed_op(exc: BaseException) -> tuple[str, str, str] | None:
    """``(op, module, error)`` when ``exc`` (or what it wraps) was raised inside an aten op; else None."""
    root: BaseException | None = exc
    while root is not None and root.__cause__ is not None:
        root = root.__cause__
    if root is None:
        return None
    op, modules = None, []
    tb = root.__traceback__
    while tb is not None:
        local = tb.tb_frame.f_locals
        func, owner = local.get("func"), local.get("self")
        if isinstance(func, torch._ops.OpOverload):
            op = func
        if isinstance(owner, nn.Module) and tb.tb_frame.f_code.co_name == "forward":
            modules.append(owner)
        tb = tb.tb_next
    if op is None:
        return None
    where = "the model's forward"
    if modules:
        names = {id(m): path for path, m in modules[0].named_modules(remove_duplicate=False)}
        where = f"{names.get(id(modules[-1])) or 'the model'} ({type(modules[-1]).__name__})"
    first = (str(root).strip().splitlines() or [type(root).__name__])[0]
    return f"aten.{op.__name__}", where, f"{type(root).__name__}: {first[:200]}"


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_FLASH = 1  # torch.nn.attention.SDPBackend.FLASH_ATTENTION as _fused_sdp_choice returns it


class CpuKernelChoice(TorchFunctionMode):
    """Run ``scaled_dot_product_attention`` on meta tensors through the kernel the CPU would pick.

    Note [attention kernels on meta]: SDPA is a composite op that picks a kernel by device;
    on meta it always decomposes into the math kernel (bmm, softmax, ...), on the CPU it
    mostly calls ``_scaled_dot_product_flash_attention_for_cpu``: other FLOP and op counts,
    so other analytic times. This mode asks the CPU's own chooser (``torch._fused_sdp_choice``,
    on tiny CPU tensors of the same dtype, heads and head size, with the dispatch modes that
    count ops switched off) and, where it picks flash attention, calls that kernel's meta
    implementation as the CPU composite does (a boolean mask turned into an additive one).
    """

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _sdpa_functions():
            return func(*args, **kwargs)
        a = dict(zip(_SDPA_ARGS, (None, None, None, None, 0.0, False, None, False)))
        a.update(zip(_SDPA_ARGS, args))
        a.update(kwargs)
        q, k, v, mask = a["query"], a["key"], a["value"], a["attn_mask"]
        if not (isinstance(q, torch.Tensor) and q.is_meta) or _cpu_choice(a) != _FLASH:
            return func(*args, **kwargs)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.where(
                mask,
                torch.scalar_tensor(0.0, dtype=q.dtype, device=mask.device),
                torch.scalar_tensor(float("-inf"), dtype=q.dtype, device=mask.device),
            )
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, a["dropout_p"], a["is_causal"], attn_mask=mask, scale=a["scale"]
        )[0]


def _sdpa_functions() -> tuple[Any, ...]:
    return (
        torch.nn.functional.scaled_dot_product_attention,
        torch.ops.aten.scaled_dot_product_attention.default,
    )


def _tiny_cpu(t: torch.Tensor) -> torch.Tensor:
    """A CPU tensor like ``t`` for the kernel chooser: dtype, heads (dim -3) and last dim kept, other dims 1."""
    shape = [1] * (t.dim() - 1) + [t.shape[-1]]
    if t.dim() >= 3:
        shape[-3] = t.shape[-3]
    return torch.empty(shape, dtype=t.dtype, requires_grad=t.requires_grad)


def _cpu_choice(a: dict[str, Any]) -> int:
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch._C.DisableTorchFunction():
        mask = a["attn_mask"]
        tiny_mask = None if mask is None else torch.empty([1] * mask.dim(), dtype=mask.dtype)
        return int(
            torch._fused_sdp_choice(
                _tiny_cpu(a["query"]),
                _tiny_cpu(a["key"]),
                _tiny_cpu(a["value"]),
                tiny_mask,
                a["dropout_p"],
                a["is_causal"],
                scale=a["scale"],
                enable_gqa=a["enable_gqa"],
            )
        )


def cost_device_kernels(on_meta: bool, cost_device: str) -> ContextManager[Any]:
    """While counting a meta trace priced for the CPU: the CPU's kernel choices (Note [attention kernels on meta])."""
    return CpuKernelChoice() if on_meta and cost_device == "cpu" else contextlib.nullcontext()
