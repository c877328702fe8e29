"""Which Python module registers a custom operator, so a stage file that calls it can import that module.

A traced graph may call operators that exist only once some module has run its registration
(``torch.ops.transformers.grouped_mm_fallback``, defined by ``transformers.integrations.moe``
when Mixtral's code imports it; an op a model file defines with ``torch.library.custom_op``).
A fresh worker that imports the stage file alone has not run it: ``AttributeError:
'_OpNamespace' 'transformers' object has no attribute ...``. :func:`registering_module` finds
the module from torch's own registries, in this order:

1. ``torch.library.custom_op`` (and ``triton_op``): ``torch._library.custom_ops.OPDEFS``
   holds the op's definition; its function's ``__module__`` is where it was defined;
2. ``torch.library.Library(...).define``: the dispatcher records the file that created the
   library (``torch._C._dispatch_dump``); the module imported from that file;
3. a fake (meta) kernel registered with ``torch.library.register_fake``: its source file;
4. an op registered from C++ by an extension: the imported package named like its namespace
   (``torchvision::nms`` -> ``torchvision``).

``aten`` and other operators built into torch need no import (:func:`import_for` gives None),
and neither can an op found nowhere (registered from C++ by a library loaded some other way).
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path
from typing import Any

import torch

__all__ = ["import_for", "registering_module", "op_qualname"]

_TORCH_DIR = Path(torch.__file__).resolve().parent
_REGISTRATION_SITE = re.compile(r"^debug: registered at (.+):\d+$", re.MULTILINE)
# torch's registration machinery: a library defined through these files says nothing about its user
_MACHINERY = (_TORCH_DIR / "library.py", _TORCH_DIR / "_library")


def op_qualname(op: Any) -> tuple[str, str]:
    """``("ns::name", "overload")`` of an ``OpOverload`` or ``OpOverloadPacket`` (overload ``""`` for a packet)."""
    if isinstance(op, torch._ops.OpOverload):
        return op._schema.name, op._overloadname
    return str(op._qualified_op_name), ""


def import_for(op: Any) -> str | None:
    """The module a stage file must import before it calls ``op``, or None: nothing for ``aten``,
    higher-order operators (Python objects of torch's own) and ops registered by ``import torch``
    itself; a torch submodule that registers ops on import (``quantized_decomposed``) is named."""
    if not isinstance(op, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        return None
    qualname, overload = op_qualname(op)
    if qualname.startswith("aten::"):
        return None
    module = registering_module(qualname, overload)
    return None if module == "torch" else module


@functools.lru_cache(maxsize=None)
def registering_module(qualname: str, overload: str = "") -> str | None:
    """The name of the imported module whose import registers the op ``qualname`` (``"ns::name"``; see the
    module docstring), or None when none is found."""
    from torch._library.custom_ops import OPDEFS

    opdef = OPDEFS.get(qualname)
    if opdef is not None:
        module = getattr(opdef._init_fn, "__module__", None)
        if module:
            return str(module)
    site = _site_module(_schema_site(qualname, overload))
    if site is not None:
        return site
    fake = _fake_kernel_module(qualname)
    if fake is not None:
        return fake
    namespace = qualname.split("::")[0]
    return namespace if namespace in sys.modules and namespace != "torch" else None


def _schema_site(qualname: str, overload: str) -> str | None:
    """The file the dispatcher says registered the op's schema."""
    name = qualname if overload in ("", "default") else f"{qualname}.{overload}"
    try:
        dump = torch._C._dispatch_dump(name)
    except RuntimeError:
        return None
    match = _REGISTRATION_SITE.search(dump)
    return match.group(1) if match else None


def _fake_kernel_module(qualname: str) -> str | None:
    """The module whose file registered a fake kernel for the op (``torch.library.register_fake``)."""
    from torch._library.simple_registry import singleton

    kernel = singleton.find(qualname).fake_impl.kernel
    source = getattr(kernel, "source", None)
    return _site_module(str(source).rsplit(":", 1)[0]) if source else None


def _site_module(filename: str | None) -> str | None:
    """The imported module loaded from ``filename``, unless it is torch's registration machinery."""
    if not filename or not filename.endswith(".py"):
        return None
    path = Path(filename).resolve()
    if any(path == m or m in path.parents for m in _MACHINERY):
        return None
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and Path(file).resolve() == path:
            return name
    return None
