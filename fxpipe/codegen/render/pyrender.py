"""Rendering Python values, imports and attribute paths as readable source text.

Objects defined in a model file are reached through
``fxpipe.modelfile.import_model_module(<model file>)`` (bound to ``_model`` in the
generated file), so classes in generated stages are the very classes the tracer saw.
"""

from __future__ import annotations

import dataclasses
import enum
import importlib
import keyword
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fxpipe.codegen.render.custom_ops import import_for, op_qualname
from fxpipe.codegen.manifest import model_file_reference
from fxpipe.errors import CodegenError

__all__ = [
    "ImportTable",
    "render_literal",
    "attr_expr",
    "is_plain_name",
    "MODEL_ALIAS",
    "MODEL_MODULE_PREFIX",
]

MODEL_ALIAS = "_model"
MODEL_MODULE_PREFIX = (
    "fxpipe_model_"  # module names under which fxpipe.modelfile imports model files
)


_MODULE_NAMES = frozenset(dir(nn.Module)) | frozenset(
    vars(nn.Module())
)  # methods and instance attributes


def is_plain_name(name: str) -> bool:
    """Whether ``obj.<name>`` is safe: an identifier that shadows nothing on ``nn.Module``."""
    return name.isidentifier() and not keyword.iskeyword(name) and name not in _MODULE_NAMES


def attr_expr(base: str, path: str) -> str:
    """``attr_expr("self", "h.0.attn")`` -> ``getattr(self.h, "0").attn`` (as torch.fx writes it)."""
    expr = base
    for part in path.split(".") if path else ():
        expr = f"{expr}.{part}" if is_plain_name(part) else f'getattr({expr}, "{part}")'
    return expr


class ImportTable:
    """Collects the import lines a generated file needs, in a stable order."""

    def __init__(self) -> None:
        self.modules: set[str] = {"torch"}
        self.names: dict[str, tuple[str, str]] = {}  # local name -> (module, attribute)
        self.model_file: str | None = None
        self.aliases: dict[str, str] = {}  # module-level `name = expression` lines
        self.functional = False  # whether `import torch.nn.functional as F` is needed
        self.reserved: set[str] = set()  # names defined in the generated file itself (its classes)
        self.model_ops: set[str] = (
            set()
        )  # operators the model file registers: a file calling one imports it

    def ref(self, obj: Any) -> str:
        """An expression that names ``obj`` (a class or function), adding the import it needs."""
        module = getattr(obj, "__module__", None)
        qualname = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None)
        if module and module.split(".")[0] == "torch":
            public = _torch_spelling(obj, module, qualname)
            if public is not None:
                return public
        if not module or not qualname or "<locals>" in qualname:
            raise CodegenError(
                f"{obj!r} cannot be imported by a generated stage (module {module!r}, "
                f"name {qualname!r}); define it at the top level of the model file"
            )
        if module.startswith(MODEL_MODULE_PREFIX):
            self._use_model_file(module, qualname)
            return f"{MODEL_ALIAS}.{qualname}"
        if module == "builtins":
            return qualname
        if module == "__main__" or not _importable(module, qualname, obj):
            raise CodegenError(
                f"{module}.{qualname} is not importable from a generated stage; "
                "define it in the model file or an installed package"
            )
        top = qualname.split(".")[0]
        taken = top in self.reserved or (top in self.names and self.names[top] != (module, top))
        local = f"{module.replace('.', '_')}_{top}" if taken else top
        self.names[local] = (module, top)
        return local + qualname[len(top) :]

    def op(self, op: Any) -> str:
        """``torch.ops.<namespace>.<name>[.<overload>]`` for a dispatcher or higher-order operator, adding the
        import of the module that registers it when plain ``import torch`` does not
        (:mod:`fxpipe.codegen.render.custom_ops`)."""
        if isinstance(op, torch._ops.HigherOrderOperator):
            return f"torch.ops.{op.namespace}.{op.__name__}"
        qualname, overload = op_qualname(op)
        text = "torch.ops." + qualname.replace("::", ".") + (f".{overload}" if overload else "")
        module = import_for(op)
        if module is not None and module.startswith(MODEL_MODULE_PREFIX):
            self._use_model_file(module, text)
            self.model_ops.add(qualname.split("::")[-1])
        elif module is not None:
            self.modules.add(module)
        return text

    def model_function_name(self, qualname: str) -> str:
        """An expression for the string ``qualname`` (``"module.name"``) that holds where the stage
        runs: a function of the model file is named by the module the stage file imports it as
        (its name derives from the file's path, which differs on another node or checkout), so the
        stage imports the model file, as it does for the file's operators; any other module's
        name is a plain string (Note [masks drawn on the host] in
        ``fxpipe.tracer.frontend.host_masks``)."""
        module, _, name = qualname.rpartition(".")
        if not module.startswith(MODEL_MODULE_PREFIX):
            return repr(qualname)
        self._use_model_file(module, qualname)
        return f"{MODEL_ALIAS}.__name__ + {'.' + name!r}"

    def _use_model_file(self, module: str, what: str) -> None:
        path = getattr(sys.modules.get(module), "__file__", None)
        if path is None:
            raise CodegenError(f"cannot find the model file that defines {what}")
        if self.model_file not in (None, path):
            raise CodegenError(
                f"a stage uses objects from two model files: {self.model_file} and {path}"
            )
        self.model_file = path

    def lines(self, build_dir: Path | None = None, used: set[str] | None = None) -> list[str]:
        """Import lines; the model file is found relative to the stage file when ``build_dir`` is given,
        so a build directory and its model file can move together (another checkout, another node).
        ``used``: the names a file uses (a build's files share one table): only their imports, and
        every plain ``import`` of a module (one may be there to register operators)."""
        needs_model = used is None or MODEL_ALIAS in used or bool(self.model_ops & used)
        model_file = self.model_file if needs_model else None
        where = None if model_file is None else repr(model_file)
        if model_file is not None and build_dir is not None:
            ref = model_file_reference(model_file, build_dir)
            if not Path(ref).is_absolute():
                where = f"os.path.join(os.path.dirname(__file__), {ref!r})"
        modules = set(self.modules) | ({"os"} if where and where.startswith("os.") else set())
        if used is not None and "operator" not in used:
            modules.discard("operator")
        out = [f"import {m}" for m in sorted(modules)]
        if self.functional and (used is None or "F" in used):
            out.append("import torch.nn.functional as F")
        for local, (module, name) in sorted(self.names.items()):
            if used is None or local in used:
                out.append(
                    f"from {module} import {name}" + (f" as {local}" if local != name else "")
                )
        if model_file is not None:
            out += [
                "",
                "from fxpipe.modelfile import import_model_module",
                "",
                f"{MODEL_ALIAS} = import_model_module({where})  # classes and functions of the model file",
            ]
        aliases = sorted((n, e) for n, e in self.aliases.items() if used is None or n in used)
        if aliases:
            out += [""] + [f"{name} = {expr}" for name, expr in aliases]
        return out


def _torch_spelling(obj: Any, module: str, qualname: str | None) -> str | None:
    """The public ``torch...`` name of a torch object, if it has one. ``__name__`` counts too: a builtin's
    qualname is ``_VariableFunctionsClass.addmm`` and ``F.max_pool2d``'s is ``boolean_dispatch.<locals>.fn``."""
    names = [n for n in (qualname, getattr(obj, "__name__", None)) if n and "<locals>" not in n]
    # the public spelling first: torch.nn.Linear, torch.Tensor; F.conv2d (is torch.conv2d), torch.addmm
    order = ("torch.nn", "torch") if isinstance(obj, type) else ("torch.nn.functional", "torch")
    for short in order + ("torch.nn", "torch.nn.functional", module):
        for name in names:
            if _resolves(importlib.import_module(short), name.split("."), obj):
                return f"{short}.{name}"
    return None


def _resolves(root: Any, parts: list[str], obj: Any) -> bool:
    cur = root
    for p in parts:
        cur = getattr(cur, p, None)
        if cur is None:
            return False
    return cur is obj


def _importable(module: str, qualname: str, obj: Any) -> bool:
    try:
        return _resolves(importlib.import_module(module), qualname.split("."), obj)
    except Exception:
        return False


def render_literal(value: Any, imports: ImportTable) -> str:
    """Python source for a constructor argument; raises CodegenError for what has no literal form."""
    if value is None or isinstance(value, (bool, int, str, bytes)):
        return repr(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return repr(value)
        return f'float("{value}")'
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"torch.device({str(value)!r})"
    if isinstance(value, enum.Enum):
        return f"{imports.ref(type(value))}.{value.name}"
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        items = [render_literal(v, imports) for v in value]
        return "(" + ", ".join(items) + ("," if len(items) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(render_literal(v, imports) for v in value) + "]"
    if isinstance(value, dict):
        return (
            "{"
            + ", ".join(
                f"{render_literal(k, imports)}: {render_literal(v, imports)}"
                for k, v in value.items()
            )
            + "}"
        )
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        args = ", ".join(
            f"{f.name}={render_literal(getattr(value, f.name), imports)}"
            for f in dataclasses.fields(value)
            if f.init
        )
        return f"{imports.ref(type(value))}({args})"
    raise CodegenError(
        f"cannot write the constructor argument {value!r} ({type(value).__name__}) as Python source; "
        "use ints, floats, strings, bools, None, tuples, lists, dicts or dataclasses"
    )
