"""Load-time initialisation of a stage whose build wrote no parameters (a meta build without ``--weights``).

Note [each stage initialises itself]: a model traced on meta with no checkpoint has no values
to write, and no process should ever hold the whole model to make some. So the build writes
only the buffers (Note [parameters on meta, buffers real] in :mod:`fxpipe.tracer.meta`) and
``load_stage`` initialises the rest of ITS stage: every tensor still on meta is materialised on
the CPU, then each module owning one runs its own ``reset_parameters()`` (torch.nn's
initialisers; ``nn.MultiheadAttention``'s ``_reset_parameters``), in module order, from the CPU
RNG seeded with ``seed + stage index`` (deterministic, the same on every device); the stage
is then moved to its device. A parameter whose module has no initialiser is drawn from
N(0, 0.02) (floating) or zeroed (a warning counts them). A parameter tied across stages
(``manifest.ties``) is drawn from N(0, 0.02) with a generator seeded by its first key, so every
stage holds the identical copy.

This is NOT bitwise the initialisation of the whole model in one process: the RNG stream is
per stage, tied weights follow the rule above, and a model's own whole-model init (e.g.
transformers' ``_init_weights`` with its config's ``initializer_range``) is not run. Train from
it, or pass ``--weights`` to start from a checkpoint.
"""

from __future__ import annotations

import warnings
import zlib
from typing import Iterable

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import Tie

__all__ = ["initialise_stage", "TIED_STD", "FALLBACK_STD"]

TIED_STD = 0.02
FALLBACK_STD = 0.02
_INITIALISERS = ("reset_parameters", "_reset_parameters")


def _materialise(module: nn.Module) -> dict[int, str]:
    """Replace every meta parameter and buffer by an uninitialised CPU tensor (aliases kept as one);
    return ``id(new tensor) -> first key``."""
    done: dict[int, torch.Tensor] = {}
    made: dict[int, str] = {}
    for path, owner in module.named_modules(remove_duplicate=False):
        for table in (owner._parameters, owner._buffers):
            for name, t in list(table.items()):
                if t is None or not t.is_meta:
                    continue
                if id(t) not in done:
                    value = torch.empty_like(t, device="cpu")
                    done[id(t)] = nn.Parameter(value, requires_grad=t.requires_grad) \
                        if isinstance(t, nn.Parameter) else value
                    made[id(done[id(t)])] = f"{path}.{name}" if path else name
                table[name] = done[id(t)]
    return made


def _initialiser(owner: nn.Module) -> object | None:
    for name in _INITIALISERS:
        fn = getattr(owner, name, None)
        if callable(fn):
            return fn
    return None


def initialise_stage(module: nn.Module, index: int, ties: Iterable[Tie] = (), *, seed: int = 0,
                     device: str | torch.device = "cpu") -> nn.Module:
    """Initialise the tensors of stage ``index`` that are still on meta (Note [each stage initialises
    itself]), in place, and move the stage to ``device``."""
    made = _materialise(module)
    if not made:
        return module.to(device)
    covered: set[int] = set()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + index)
        for owner in module.modules():
            own = [t for t in list(owner._parameters.values()) + list(owner._buffers.values())
                   if t is not None and id(t) in made]
            init = _initialiser(owner)
            if own and init is not None:
                with torch.no_grad():
                    init()  # type: ignore[operator]
                covered.update(id(t) for t in owner.parameters() if id(t) in made)
                covered.update(id(t) for t in owner.buffers() if id(t) in made)
        rest = [t for _, t in _named_tensors(module) if id(t) in made and id(t) not in covered]
        with torch.no_grad():
            for t in rest:
                t.normal_(0.0, FALLBACK_STD) if t.is_floating_point() else t.zero_()
    if rest:
        warnings.warn(f"fxpipe: stage {index}: {len(rest)} tensors have no module initialiser "
                      f"({sorted(made[id(t)] for t in rest)[:3]}...); drawn from N(0, {FALLBACK_STD}) "
                      "(integers: zero)", stacklevel=2)
    _tie(module, made, ties, seed)
    return module.to(device)


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))


def _tie(module: nn.Module, made: dict[int, str], ties: Iterable[Tie], seed: int) -> None:
    """Give every parameter tied across stages the same values in each stage (Note [each stage initialises itself])."""
    named = dict(_named_tensors(module))
    for tie in ties:
        for key in tie.keys:
            t = named.get(key)
            if t is None or id(t) not in made:
                continue
            g = torch.Generator().manual_seed(seed + zlib.crc32(tie.keys[0].encode()))
            with torch.no_grad():
                t.copy_(torch.randn(t.shape, generator=g, dtype=t.dtype) * TIED_STD)
