"""Constructor expressions for leaf modules, checked by rebuilding them on the meta device.

A standard ``torch.nn`` layer is rebuilt from its hyperparameters: each ``__init__``
parameter is read from the same-named attribute (``bias`` and other flags whose
attribute holds a tensor or ``None`` become ``attr is not None``; ``device`` and
``dtype`` are skipped unless the weights are not the default dtype). A user-defined
leaf is rebuilt from the arguments its ``__init__`` received, recorded by the tracer
(``TracedModel.user_leaf_args``). Either way the expression is evaluated on the meta
device and must give the same parameter and buffer names, shapes and dtypes and the
same ``repr`` as the original, or a CodegenError names the module.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.pyrender import MODEL_ALIAS, ImportTable, render_literal
from fxpipe.errors import CodegenError

__all__ = ["leaf_constructor", "is_torch_nn"]


def is_torch_nn(module: nn.Module) -> bool:
    """Whether the module's class comes from ``torch.nn`` (rebuilt from hyperparameters)."""
    return type(module).__module__.startswith("torch.nn.")


def leaf_constructor(path: str, module: nn.Module, imports: ImportTable,
                     user_args: tuple[tuple, dict] | None = None) -> str:
    """Source text that rebuilds ``module`` (found at ``path``), verified on the meta device."""
    if is_torch_nn(module):
        args, kwargs = _drop_redundant(module, *_nn_arguments(path, module))
    elif user_args is not None:
        args, kwargs = tuple(user_args[0]), dict(user_args[1])
    else:
        raise CodegenError(
            f"leaf module {path!r} ({type(module).__qualname__}) is not a torch.nn layer and the tracer recorded no "
            "constructor arguments for it; trace the model with fxpipe's tracer so its __init__ arguments are recorded")
    rendered = [render_literal(a, imports) for a in args]
    rendered += [f"{k}={render_literal(v, imports)}" for k, v in kwargs.items()]
    expr = f"{imports.ref(type(module))}({', '.join(rendered)})"
    _verify(path, module, expr, imports)
    return expr


def _nn_arguments(path: str, module: nn.Module) -> tuple[tuple, dict]:
    sig = inspect.signature(type(module).__init__)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    dtypes = {t.dtype for t in module.parameters(recurse=True)} or {torch.get_default_dtype()}
    for name, p in list(sig.parameters.items())[1:]:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or name == "device" or name.startswith("_"):
            continue
        if name == "dtype":
            if dtypes != {torch.get_default_dtype()} and len(dtypes) == 1:
                kwargs["dtype"] = next(iter(dtypes))
            continue
        has_default = p.default is not inspect.Parameter.empty
        if not hasattr(module, name):
            if has_default:
                continue  # not recorded on the module: keep the default, the check below decides
            raise CodegenError(f"cannot rebuild {path!r} ({type(module).__name__}): its __init__ argument {name!r} "
                               "is not stored on the module; wrap it in a user-defined leaf module instead")
        value = getattr(module, name)
        if isinstance(value, torch.Tensor) or (value is None and isinstance(p.default, bool)):
            value = value is not None
        if isinstance(value, (nn.Module, torch.Tensor)):
            raise CodegenError(f"cannot rebuild {path!r} ({type(module).__name__}): argument {name!r} is a "
                               f"{type(value).__name__}, not a hyperparameter")
        if not has_default and p.kind is p.POSITIONAL_OR_KEYWORD and not kwargs:
            args.append(value)
        elif not has_default or not _equal(value, p.default):
            kwargs[name] = value
    return tuple(args), kwargs


def _drop_redundant(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Leave out keywords whose default rebuilds the same layer (``dilation=(1, 1)`` is ``1``)."""
    want = (_state_signature(module), repr(module))
    defaults = inspect.signature(type(module).__init__).parameters
    for name in list(kwargs):
        if name == "dtype" or defaults[name].default is inspect.Parameter.empty:
            continue
        trial = {k: v for k, v in kwargs.items() if k != name}
        try:
            with torch.device("meta"):
                rebuilt = type(module)(*args, **trial)
        except Exception:
            continue
        if (_state_signature(rebuilt), repr(rebuilt)) == want:
            kwargs = trial
    return args, kwargs


def _equal(a: Any, b: Any) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except Exception:
        return False


def _state_signature(module: nn.Module) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    named = list(module.named_parameters(remove_duplicate=False)) + list(module.named_buffers(remove_duplicate=False))
    return sorted((k, tuple(v.shape), v.dtype) for k, v in named)


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
        raise CodegenError(f"rebuilding leaf module {path!r} as `{expr}` failed: {type(exc).__name__}: {exc}") from exc
    want, got = _state_signature(module), _state_signature(rebuilt)
    if want != got:
        diff = sorted(set(want) ^ set(got))[:4]
        raise CodegenError(f"rebuilding leaf module {path!r} as `{expr}` gives different parameters or buffers "
                           f"(first differences: {diff}); make it a user-defined leaf module whose __init__ "
                           "arguments fxpipe records")
    if repr(rebuilt) != repr(module):
        raise CodegenError(f"rebuilding leaf module {path!r} as `{expr}` gives {rebuilt!r}, expected {module!r}")
