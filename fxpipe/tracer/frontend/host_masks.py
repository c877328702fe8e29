"""SpecAugment's masks, drawn with numpy on the host by the model's own function at every call.

Note [masks drawn on the host]: Wav2Vec2, HuBERT, WavLM, Data2VecAudio, SEW, UniSpeech and the
other speech encoders of transformers mask their features in train mode (SpecAugment, on by
default: ``mask_time_prob=0.05``) with ``_compute_mask_indices(shape, mask_prob, mask_length,
attention_mask, min_masks)``, a numpy function that draws from numpy's global random state and
returns a boolean array the model turns into a tensor. A trace would keep the one draw it saw as a
constant (Note [numpy random numbers]). While tracing, :func:`host_masks_lifted` puts the operator
``fxpipe::host_mask_indices`` in that function's place: the graph records a call with the sizes
as they are (the batch and the length stay symbolic), and a stage calls the model's own function
again at every step, on the host, from numpy's global random state, as the model does. The
operator names the function it calls (``module.name``); it is imported where the stage runs.

The draws are the model's, in the model's order: the stage that holds the masking draws once per
microbatch, microbatches in order, so a job whose ranks seed numpy as the one-process run does
draws the masks that run draws microbatch by microbatch. Two things would draw again and are
kept from it: activation recomputation restores numpy's state with torch's (Note [numpy under
recomputation] in :mod:`fxpipe.runtime.pipeline.stage_io`), and the operator is tagged
``nondeterministic_seeded``, so a compiler neither merges two calls nor recomputes one.

Only functions named ``_compute_mask_indices`` with exactly those parameters are lifted, in
modules already imported (the model's own module, or a model file's copy), and wherever a module
imported one under that name (a model file's ``from transformers... import
_compute_mask_indices``: its operator names the module that defines it); any other numpy draw is
refused, naming its line (:mod:`fxpipe.tracer.frontend.host_random`).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import warnings
from typing import Any, Callable, Iterator, Optional

import torch

from fxpipe.errors import BuildDirError

__all__ = ["host_mask_indices", "host_masks_lifted"]

_NAME = "_compute_mask_indices"
_PARAMETERS = ("shape", "mask_prob", "mask_length", "attention_mask", "min_masks")
# "module.name" -> the function itself, while a trace has it replaced in its module
_ORIGINALS: dict[str, Callable[..., Any]] = {}


@torch.library.custom_op(
    "fxpipe::host_mask_indices", mutates_args=(), tags=(torch.Tag.nondeterministic_seeded,)
)
def host_mask_indices(
    function: str,
    shape: list[int],
    mask_prob: float,
    mask_length: int,
    attention_mask: Optional[torch.Tensor],
    min_masks: int,
) -> torch.Tensor:
    """``function(shape, ...)`` (a ``module.name`` of a SpecAugment mask function), called on the
    host, as a boolean tensor of ``shape`` on the CPU (Note [masks drawn on the host])."""
    import numpy as np

    fn = _ORIGINALS.get(function) or _imported(function)
    mask = fn(tuple(shape), mask_prob, mask_length, attention_mask, min_masks)
    return torch.from_numpy(np.ascontiguousarray(mask, dtype=np.bool_))


def _imported(function: str) -> Callable[..., Any]:
    """The function ``function`` (``module.name``) names, imported where the stage runs."""
    module, _, name = function.rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as exc:
        raise BuildDirError(
            f"the stage draws SpecAugment's masks with {function}, which this process cannot "
            f"import ({type(exc).__name__}: {exc}); run with the packages the build was "
            "partitioned with, or partition it again"
        ) from None


@host_mask_indices.register_fake
def _(
    function: str,
    shape: list[int],
    mask_prob: float,
    mask_length: int,
    attention_mask: Optional[torch.Tensor],
    min_masks: int,
) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.bool)


def _lifted(qualname: str) -> Callable[..., torch.Tensor]:
    def draw(
        shape: tuple[int, int],
        mask_prob: float,
        mask_length: int,
        attention_mask: Optional[torch.Tensor] = None,
        min_masks: int = 0,
    ) -> torch.Tensor:
        return host_mask_indices(
            qualname,
            list(shape),
            float(mask_prob),
            int(mask_length),
            attention_mask,
            int(min_masks),
        )

    return draw


def _mask_functions() -> tuple[
    dict[str, Callable[..., Any]], list[tuple[Any, str, Callable[..., Any]]]
]:
    """One pass over the imported modules: ``{"module.name": function}`` for every SpecAugment
    mask function, keyed by the module that defines it, and ``(module, "defining_module.name",
    function)`` for every module that holds one, the defining module and any that imported it
    (a model file's ``from transformers.models.wav2vec2.modeling_wav2vec2 import
    _compute_mask_indices``), each to call the operator naming the module that defines it."""
    held = []
    for module_name, module in list(sys.modules.items()):
        fn = getattr(module, "__dict__", {}).get(_NAME)
        if callable(fn):
            held.append((module_name, module, fn))
    found: dict[str, Callable[..., Any]] = {}
    for module_name, _, fn in held:
        if getattr(fn, "__module__", None) != module_name:
            continue  # imported from elsewhere: found where it is defined
        try:
            names = tuple(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            continue
        if names == _PARAMETERS:
            found[f"{module_name}.{_NAME}"] = fn
    by_id = {id(fn): qualname for qualname, fn in found.items()}
    bindings = [(module, by_id[id(fn)], fn) for _, module, fn in held if id(fn) in by_id]
    return found, bindings


@contextlib.contextmanager
def host_masks_lifted() -> Iterator[None]:
    """Within the block, every imported SpecAugment mask function is the operator
    ``fxpipe::host_mask_indices`` calling it, in its own module and in those that imported it
    (Note [masks drawn on the host])."""
    found, bindings = _mask_functions()
    _ORIGINALS.update(found)
    for module, qualname, _ in bindings:
        setattr(module, _NAME, _lifted(qualname))
    try:
        with warnings.catch_warnings():
            # the model builds its mask with torch.tensor(<the operator's tensor>)
            warnings.filterwarnings("ignore", message="To copy construct from a tensor")
            yield
    finally:
        for module, _, fn in bindings:
            setattr(module, _NAME, fn)
        for qualname in found:
            _ORIGINALS.pop(qualname, None)
