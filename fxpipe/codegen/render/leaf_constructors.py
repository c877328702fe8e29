"""Constructor expressions for leaf modules, checked by rebuilding them on the meta device.

A standard ``torch.nn`` layer is rebuilt from its hyperparameters
(:func:`fxpipe.tracer.construct.rebuild.torch_nn_arguments`, keywords that change nothing left out); a
user-defined leaf from the arguments its ``__init__`` received, recorded by the tracer
(``TracedModel.user_leaf_args``). Either way the rendered expression is evaluated on the meta
device and must give a module equal to the original in its whole configuration (Note
[rebuilt modules equal the original] in :mod:`fxpipe.tracer.construct.rebuild`), or a CodegenError names
the module, the difference and the remedy.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.render.pyrender import MODEL_ALIAS, ImportTable, render_literal
from fxpipe.errors import CodegenError
from fxpipe.tracer.construct.rebuild import (
    NotRebuildable,
    configuration_difference,
    drop_redundant,
    is_torch_nn,
    torch_nn_arguments,
)

__all__ = ["leaf_constructor", "is_torch_nn"]

_REMEDY = (
    "trace the model with --frontend export (trace_model(..., frontend='export')), which looks into every "
    "module, or make it a user-defined module whose __init__ arguments fxpipe records"
)


def leaf_constructor(
    path: str, module: nn.Module, imports: ImportTable, user_args: tuple[tuple, dict] | None = None
) -> str:
    """Source text that rebuilds ``module`` (found at ``path``), verified on the meta device."""
    if is_torch_nn(module):
        try:
            args, kwargs = drop_redundant(module, *torch_nn_arguments(module))
        except NotRebuildable as exc:
            raise CodegenError(
                f"cannot rebuild {path!r} ({type(module).__name__}): {exc}; {_REMEDY}"
            ) from None
    elif user_args is not None:
        args, kwargs = tuple(user_args[0]), dict(user_args[1])
    else:
        raise CodegenError(
            f"leaf module {path!r} ({type(module).__qualname__}) is not a torch.nn layer and the tracer recorded no "
            "constructor arguments for it; trace the model with fxpipe's tracer so its __init__ arguments are recorded"
        )
    rendered = [render_literal(a, imports) for a in args]
    rendered += [f"{k}={render_literal(v, imports)}" for k, v in kwargs.items()]
    expr = f"{imports.ref(type(module))}({', '.join(rendered)})"
    _verify(path, module, expr, imports)
    return expr


def _verify(path: str, module: nn.Module, expr: str, imports: ImportTable) -> None:
    namespace: dict[str, Any] = {"torch": torch}
    if imports.model_file is not None:
        from fxpipe.modelfile import import_model_module

        namespace[MODEL_ALIAS] = import_model_module(imports.model_file)
    for local, (mod, name) in imports.names.items():
        namespace[local] = getattr(__import__(mod, fromlist=[name]), name)
    try:
        with torch.device("meta"):
            rebuilt = eval(expr, namespace)  # noqa: S307 - our own rendered source, checked before it is written
    except Exception as exc:
        raise CodegenError(
            f"rebuilding leaf module {path!r} as `{expr}` failed: {type(exc).__name__}: {exc}"
        ) from exc
    difference = configuration_difference(module, rebuilt)
    if difference is not None:
        raise CodegenError(
            f"rebuilding leaf module {path!r} as `{expr}` gives a different module: {difference}; "
            f"{_REMEDY}"
        )
