"""Load-time initialisation of a stage whose build wrote no parameters (a meta build without ``--weights``).

Note [each stage initialises itself]: a model traced on meta with no checkpoint has no values
to write, and no process should ever hold the whole model to make some. So the build writes
only the buffers (Note [parameters on meta, buffers real] in :mod:`fxpipe.tracer.measure.meta`) and
``load_stage`` initialises the rest of ITS stage: every tensor still on meta is materialised on
the CPU and initialised from the CPU RNG seeded with ``seed + stage index`` (deterministic, the
same on every device); the stage is then moved to its device.

- Tensors that came from a transformers ``PreTrainedModel`` (``manifest.init_models``: the
  outermost ones, with their class and config) are initialised by that model's own
  ``_init_weights``: the model is built again on meta from its config (no memory), this stage's
  CPU tensors are put in place of its meta ones under the same keys, and its
  ``initialize_weights()`` runs (transformers' own traversal, children before parents), which
  writes only this stage's tensors (the rest are meta: their ops do nothing). So a Linear or
  Embedding weight is N(0, ``config.initializer_range``), a bias zero, a LayerNorm/RMSNorm
  weight one, GPT-2's residual projections scaled by ``1/sqrt(2 n_layer)``, as in the model.
  A tensor the model's init leaves unwritten (still NaN) falls through to the next rule.
- Otherwise each module owning one runs its own ``reset_parameters()`` (torch.nn's
  initialisers; ``nn.MultiheadAttention``'s ``_reset_parameters``), in module order. A
  parameter whose module has no initialiser is drawn from N(0, 0.02) (floating) or zeroed
  (a warning counts them).
- A parameter tied across stages (``manifest.ties``) is drawn with the RNG seeded by its first
  key, so every stage holds the identical copy: by ``_init_weights`` of the module owning that
  first key when it came from a transformers model, else from N(0, 0.02).

This is NOT bitwise the initialisation of the whole model in one process: the RNG stream is
per stage, and tied weights follow the rule above; the distributions are the model's own.
Train from it, or pass ``--weights`` to start from a checkpoint.
"""

from __future__ import annotations

import importlib
import json
import sys
import warnings
import zlib
from typing import Any, Iterable

import torch
import torch.nn as nn

from fxpipe.codegen.manifest import InitModel, Tie
from fxpipe.errors import BuildDirError

__all__ = ["initialise_stage", "transformers_init_models", "TIED_STD", "FALLBACK_STD"]

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
                    done[id(t)] = (
                        nn.Parameter(value, requires_grad=t.requires_grad)
                        if isinstance(t, nn.Parameter)
                        else value
                    )
                    made[id(done[id(t)])] = f"{path}.{name}" if path else name
                table[name] = done[id(t)]
    return made


def _initialiser(owner: nn.Module) -> object | None:
    for name in _INITIALISERS:
        fn = getattr(owner, name, None)
        if callable(fn):
            return fn
    return None


def initialise_stage(
    module: nn.Module,
    index: int,
    ties: Iterable[Tie] = (),
    *,
    seed: int = 0,
    device: str | torch.device = "cpu",
    init_models: Iterable[InitModel] = (),
) -> nn.Module:
    """Initialise the tensors of stage ``index`` that are still on meta (Note [each stage initialises
    itself]), in place, and move the stage to ``device``."""
    made = _materialise(module)
    if not made:
        return module.to(device)
    covered: set[int] = set()
    models: list[tuple[InitModel, nn.Module]] = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + index)
        for spec in init_models:
            hf = _build_on_meta(spec)
            covered |= _transformers_init(module, made, spec, hf)
            models.append((spec, hf))
        for owner in module.modules():
            own = [
                t
                for t in list(owner._parameters.values()) + list(owner._buffers.values())
                if t is not None and id(t) in made and id(t) not in covered
            ]
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
        warnings.warn(
            f"fxpipe: stage {index}: {len(rest)} tensors have no module initialiser "
            f"({sorted(made[id(t)] for t in rest)[:3]}...); drawn from N(0, {FALLBACK_STD}) "
            "(integers: zero)",
            stacklevel=2,
        )
    _tie(module, made, ties, seed, models)
    return module.to(device)


def transformers_init_models(model: nn.Module) -> tuple[InitModel, ...]:
    """The outermost transformers ``PreTrainedModel``s in ``model`` (itself included), recorded so that
    ``load_stage`` can run their ``_init_weights`` (Note [each stage initialises itself])."""
    if "transformers" not in sys.modules:  # a model built with transformers has imported it
        return ()
    from transformers import PreTrainedModel

    found: list[InitModel] = []
    for path, m in model.named_modules():
        if not isinstance(m, PreTrainedModel) or any(_under(path, f.prefix) for f in found):
            continue
        config = m.config
        found.append(
            InitModel(
                prefix=path,
                model_class=_qualname(type(m)),
                config_class=_qualname(type(config)),
                config=json.dumps(config.to_dict(), sort_keys=True, default=str),
            )
        )
    return tuple(found)


def _under(key: str, prefix: str) -> bool:
    return not prefix or key == prefix or key.startswith(prefix + ".")


def _qualname(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _resolve(name: str) -> Any:
    module, _, qualname = name.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _build_on_meta(spec: InitModel) -> nn.Module:
    """The transformers model of ``spec``, built on meta from its recorded config."""
    from transformers import PretrainedConfig, PreTrainedModel

    try:
        cls, config_cls = _resolve(spec.model_class), _resolve(spec.config_class)
        if not (
            isinstance(cls, type)
            and issubclass(cls, PreTrainedModel)
            and isinstance(config_cls, type)
            and issubclass(config_cls, PretrainedConfig)
        ):
            raise TypeError(f"{spec.model_class} is not a transformers PreTrainedModel")
        config = config_cls.from_dict(json.loads(spec.config))
        with torch.device("meta"):
            return cls(config)
    except Exception as exc:  # noqa: BLE001 - an import, a config or a constructor error alike
        raise BuildDirError(
            f"cannot build {spec.model_class} on meta to initialise its stage tensors "
            f"({type(exc).__name__}: {exc}); install the transformers version that built it, "
            "or pass --weights"
        ) from None


def _transformers_init(
    module: nn.Module, made: dict[int, str], spec: InitModel, hf: nn.Module
) -> set[int]:
    """Run ``hf``'s own ``initialize_weights`` with this stage's tensors in place of its meta ones;
    the ids of the tensors it wrote (Note [each stage initialises itself])."""
    mine = _swap_in(module, made, spec, hf)
    with torch.no_grad():
        for t in mine:
            t.fill_(float("nan")) if t.is_floating_point() else t.zero_()
        whole = getattr(hf, "initialize_weights", None)  # transformers >= 4.50; before: apply()
        if callable(whole):
            whole()
        else:
            hf.apply(getattr(hf, "_initialize_weights"))
    return {id(t) for t in mine if not (t.is_floating_point() and bool(torch.isnan(t).any()))}


def _swap_in(
    module: nn.Module, made: dict[int, str], spec: InitModel, hf: nn.Module
) -> list[torch.Tensor]:
    """Put the stage's materialised tensors under ``spec.prefix`` into ``hf`` at the same keys."""
    mine: list[torch.Tensor] = []
    for key, t in _named_tensors(module):
        if id(t) not in made or not _under(key, spec.prefix):
            continue
        table = _table_of(hf, key[len(spec.prefix) + 1 :] if spec.prefix else key)
        if table is None:
            continue
        owner_table, name = table
        if tuple(owner_table[name].shape) == tuple(t.shape):
            owner_table[name] = t
            if all(t is not m for m in mine):
                mine.append(t)
    return mine


def _table_of(model: nn.Module, key: str) -> tuple[dict[str, Any], str] | None:
    owner_path, _, name = key.rpartition(".")
    try:
        owner = model.get_submodule(owner_path)
    except AttributeError:
        return None
    for table in (owner._parameters, owner._buffers):
        if table.get(name) is not None:
            return table, name
    return None


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters(remove_duplicate=False)) + list(
        module.named_buffers(remove_duplicate=False)
    )


def _tie(
    module: nn.Module,
    made: dict[int, str],
    ties: Iterable[Tie],
    seed: int,
    models: list[tuple[InitModel, nn.Module]],
) -> None:
    """Give every parameter tied across stages the same values in each stage (Note [each stage initialises itself])."""
    named = dict(_named_tensors(module))
    for tie in ties:
        first = tie.keys[0]
        for key in tie.keys:
            t = named.get(key)
            if t is None or id(t) not in made:
                continue
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed + zlib.crc32(first.encode()))
                if not _tie_by_transformers(t, first, models):
                    with torch.no_grad():
                        t.copy_(torch.randn(t.shape, dtype=t.dtype) * TIED_STD)


def _tie_by_transformers(
    t: torch.Tensor, first: str, models: list[tuple[InitModel, nn.Module]]
) -> bool:
    """Initialise ``t`` as ``_init_weights`` initialises the module owning ``first``, alone (its other
    tensors set aside on meta); False when no transformers model holds ``first``."""
    for spec, hf in models:
        if not _under(first, spec.prefix):
            continue
        rel = first[len(spec.prefix) + 1 :] if spec.prefix else first
        table = _table_of(hf, rel)
        if table is None:
            return False
        owner = hf.get_submodule(rel.rpartition(".")[0])
        kept = dict(owner._parameters), dict(owner._buffers)
        tables: tuple[dict[str, Any], ...] = (owner._parameters, owner._buffers)
        for tab in tables:
            for name, v in tab.items():
                if v is not None:
                    tab[name] = v.to("meta")
        table[0][table[1]] = t
        try:
            with torch.no_grad():
                t.fill_(float("nan")) if t.is_floating_point() else t.zero_()
                hf._init_weights(owner)  # type: ignore[operator]
        finally:
            owner._parameters.clear()
            owner._parameters.update(kept[0])
            owner._buffers.clear()
            owner._buffers.update(kept[1])
        return not (t.is_floating_point() and bool(torch.isnan(t).any()))
    return False
