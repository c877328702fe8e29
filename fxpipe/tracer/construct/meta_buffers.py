"""Computed buffers of a model that built itself on the meta device, recomputed on the CPU.

Note [computed buffers on meta]: a factory that builds the whole model under
``with torch.device("meta")`` (torchtitan's way) leaves its buffers on meta too: RoPE
frequencies, causal masks, position ids. No checkpoint holds them (they are computed, often
non-persistent), yet they are part of the model, and a stage needs their values. Each module
that owns meta buffers is built again on the CPU, its parameters on meta (no memory, Note
[parameters on meta, buffers real] in :mod:`fxpipe.tracer.measure.meta`), and its buffers are taken
from the rebuilt module:

1. from its constructor's recorded arguments (:func:`fxpipe.tracer.build_model_recorded`,
   which ``trace_model_file`` uses), a ``device`` argument of meta made the CPU; or
2. from its ``config`` attribute, for a module built from its config alone (transformers'
   way: ``LlamaRotaryEmbedding(config)`` computes its frequencies with its ``rope_init_fn``),
   when no constructor was recorded (a model given to ``trace_model`` directly).

A value is taken only when the rebuilt buffer has the meta one's shape; it is cast to the meta
buffer's dtype (a model cast after it was built). Every recomputed buffer is named in one line
(``ModelProfile.recomputed_buffers``, printed by the CLI); a buffer none of these recovers is
left to the existing error, which names it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn

from fxpipe.tracer.construct.construction import CtorArgs
from fxpipe.tracer.measure.meta import META, build_on_meta

__all__ = ["recompute_meta_buffers"]


def recompute_meta_buffers(
    model: nn.Module, ctor_args: Mapping[str, CtorArgs] | None = None
) -> tuple[dict[str, torch.Tensor], tuple[str, ...]]:
    """``(values, lines)``: the CPU value of every meta buffer of ``model`` that can be
    recomputed, by key, and one line per buffer saying how (Note [computed buffers on meta])."""
    values: dict[str, torch.Tensor] = {}
    lines: list[str] = []
    done: set[int] = set()
    for path, module in model.named_modules(remove_duplicate=False):
        names = [n for n, b in module._buffers.items() if b is not None and b.is_meta]
        if not names or id(module) in done:
            continue
        done.add(id(module))
        found = _rebuilt_buffers(module, (ctor_args or {}).get(path))
        if found is None:
            continue
        buffers, how = found
        for name in names:
            meta = module._buffers[name]
            value = buffers.get(name)
            if value is None or value.is_meta or value.shape != meta.shape:
                continue
            key = f"{path}.{name}" if path else name
            values[key] = value.detach().to(dtype=meta.dtype)
            lines.append(
                f"{key}: built on the meta device; recomputed on the CPU ({how}), "
                f"{str(meta.dtype).removeprefix('torch.')}{list(meta.shape)}"
            )
    return values, tuple(lines)


def _rebuilt_buffers(
    module: nn.Module, ctor: CtorArgs | None
) -> tuple[dict[str, torch.Tensor | None], str] | None:
    """The buffers of ``module`` built again on the CPU, and how; ``None`` when it cannot be."""
    cls = type(module)
    config = getattr(module, "config", None)
    attempts = []
    if ctor is not None:
        args, kwargs = ctor
        args = tuple(_off_meta(a) for a in args)
        kwargs = {k: _off_meta(v) for k, v in kwargs.items()}
        attempts.append((args, kwargs, "rebuilt from its constructor's arguments"))
    if config is not None and not isinstance(config, (int, float, str, bool)):
        attempts.append(((config,), {}, "rebuilt from its config"))
    for args, kwargs, how in attempts:
        try:
            with torch.device("cpu"), _quiet():
                rebuilt = build_on_meta(lambda: cls(*args, **kwargs))
        except Exception:  # noqa: BLE001 - a constructor that cannot run again: try the next way
            continue
        return dict(rebuilt._buffers), f"{cls.__name__} {how}"
    return None


def _off_meta(value: Any) -> Any:
    """A constructor argument for the CPU rebuild: the meta device becomes the CPU."""
    if isinstance(value, torch.device) and value.type == META:
        return torch.device("cpu")
    if isinstance(value, str) and value == META:
        return "cpu"
    return value


@contextlib.contextmanager
def _quiet() -> Any:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
