"""FairScale's ``enable_wrap`` / ``wrap`` / ``auto_wrap``: which submodules become FSDP units.

``with enable_wrap(wrapper_cls=FullyShardedDataParallel, **options):`` makes ``wrap(m)``
return ``wrapper_cls(m, **options)`` (elsewhere ``wrap`` returns ``m`` untouched), and
``auto_wrap(module, min_num_params=N)`` wrap, children first, every submodule that
FairScale's default policy picks (``fxpipe.runtime.dataparallel.fsdp_units``). FSDP2 shards in
place (Note [sharded in place] in ``fsdp.py``), so a wrapped child stays where it was. (The module
is ``wrapping``, not ``wrap``, so that the function ``fxpipe.sharding.wrap`` is not shadowed.)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch.nn as nn

from fxpipe.errors import ConfigError
from fxpipe.runtime.dataparallel.fsdp_units import (
    WrapPolicy,
    auto_wrap_units,
    default_auto_wrap_policy,
)

__all__ = ["enable_wrap", "wrap", "auto_wrap", "default_auto_wrap_policy"]

_CONTEXT: list[tuple[WrapPolicy | None, dict[str, Any]]] = []


@contextlib.contextmanager
def enable_wrap(
    auto_wrap_policy: WrapPolicy | None = None, **wrapper_kwargs: Any
) -> Iterator[None]:
    """Inside, ``wrap`` and ``auto_wrap`` wrap with ``wrapper_cls`` (a keyword argument, required)
    and the other ``wrapper_kwargs``; ``auto_wrap_policy`` is ``auto_wrap``'s default policy."""
    if "wrapper_cls" not in wrapper_kwargs:
        raise ConfigError(
            "enable_wrap needs wrapper_cls=..., e.g. enable_wrap(wrapper_cls=FullyShardedDataParallel)"
        )
    if _CONTEXT:
        raise ConfigError("enable_wrap contexts cannot be nested")
    _CONTEXT.append((auto_wrap_policy, wrapper_kwargs))
    try:
        yield
    finally:
        _CONTEXT.pop()


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """``wrapper_cls(module, **options)`` inside ``enable_wrap`` (``wrap_overrides`` win), else ``module``."""
    if not _CONTEXT:
        return module
    options = {**_CONTEXT[-1][1], **wrap_overrides}
    wrapper_cls = options.pop("wrapper_cls")
    return wrapper_cls(module, **options)


def auto_wrap(
    module: nn.Module,
    auto_wrap_policy: WrapPolicy | None = None,
    min_num_params: float | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Wrap ``module``'s submodules (and ``module`` itself when the policy says so) inside
    ``enable_wrap``; ``min_num_params`` picks FairScale's default policy with that threshold.
    Returns ``module``. ``kwargs`` override the wrapper's options."""
    if not _CONTEXT:
        return module
    if auto_wrap_policy is not None and min_num_params is not None:
        raise ConfigError("auto_wrap: give auto_wrap_policy or min_num_params, not both")
    policy = auto_wrap_policy or _CONTEXT[-1][0]
    if min_num_params is not None or policy is None:
        policy = functools.partial(
            default_auto_wrap_policy,
            min_num_params=min_num_params if min_num_params is not None else 1e8,
        )
    for unit in auto_wrap_units(module, policy):
        wrap(unit, **kwargs)
    return module
