"""Model files: the contract by which users hand fxpipe a model.

A model file defines ``build_model() -> nn.Module`` and ``example_inputs(batch_size: int)``,
which returns the model's call on ``batch_size`` samples: a tuple (positional arguments),
a dict (keyword arguments, e.g. a Hugging Face ``input_ids=, attention_mask=, labels=``
call) or an ``(args, kwargs)`` pair. Tensors are the model's inputs; ``None`` and other
plain constants are constants of the trace (Note [the traced call] in
``fxpipe.tracer.call``). Optionally ``loss_fn(output, target) -> Tensor`` and
``example_targets(batch_size: int)`` for training; without a ``loss_fn`` training uses
the loss the model computes itself (``output.loss``, e.g. when it is given ``labels=``).
``path.py:name`` picks another model function inline.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, Callable, Iterator

from fxpipe.errors import FxpipeError, ModelFileError
from fxpipe.unexpected import ExitCalled, exits_raise
from fxpipe.userfiles import open_regular, read_regular

if TYPE_CHECKING:
    from fxpipe.model_inputs import ModelInputs

__all__ = [
    "ModelSource",
    "load_model_file",
    "import_model_module",
    "import_model_bytes",
    "checked_model_import",
    "file_sha256",
]


def file_sha256(path: str | Path) -> str:
    """Hex sha256 of a file's bytes."""
    h = hashlib.sha256()
    with os.fdopen(open_regular(path, "file", FxpipeError), "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _module_name(path: Path) -> str:
    digest = hashlib.sha1(str(path).encode()).hexdigest()[:10]
    return f"fxpipe_model_{path.stem}_{digest}"


def import_model_module(path: str | Path) -> ModuleType:
    """Import a model file under a stable module name derived from its path.

    The same file always maps to the same module, so classes defined in it are the
    same objects whether the tracer, a generated stage file or a test imports them.
    Note [what is hashed is what runs]: the file is read once, and the module is reused
    only while it was imported from those same bytes; a file edited since (a notebook that
    partitions, edits the model and partitions again) is imported again from its new bytes,
    so the tracer, the manifest's hash and the stages all see the file as it is. While a
    build's stages are loaded (:func:`checked_model_import`), the module imported from the
    build's checked bytes is returned instead, never the file re-read.
    """
    path = Path(path).resolve()
    name = _module_name(path)
    pinned = _pinned.get(name)
    if pinned is not None:
        return pinned
    try:  # a FIFO is refused, never waited on (Note [regular files only] in fxpipe.userfiles)
        data = read_regular(path, "model file", ModelFileError)
    except FileNotFoundError:
        raise ModelFileError(f"model file {str(path)!r} does not exist") from None
    if path.suffix != ".py":
        raise ModelFileError(f"cannot import {str(path)!r}: not a Python file")
    module = sys.modules.get(name)
    if (
        module is not None
        and getattr(module, "__fxpipe_sha256__", None) == hashlib.sha256(data).hexdigest()
    ):
        return module
    return _execute(path, name, data)


def import_model_bytes(path: str | Path, data: bytes) -> ModuleType:
    """The model file ``path`` imported from ``data``, bytes already checked against a build's
    manifest, under the name ``import_model_module`` gives it (so a stage file's import finds it).

    A module of that name imported from other bytes (the file changed since) is replaced:
    what runs is exactly what was checked, and the file is never read again.
    """
    path = Path(path).resolve()
    name = _module_name(path)
    module = sys.modules.get(name)
    if (
        module is not None
        and getattr(module, "__fxpipe_sha256__", None) == hashlib.sha256(data).hexdigest()
    ):
        return module
    return _execute(path, name, data)


_pinned: dict[str, ModuleType] = {}  # module name -> the module a stage being loaded must see


@contextlib.contextmanager
def checked_model_import(module: ModuleType) -> Iterator[None]:
    """Within the block, ``import_model_module`` of ``module``'s file returns ``module`` (imported from a
    build's checked bytes) without reading the file (Note [what is hashed is what runs])."""
    previous = _pinned.get(module.__name__)
    _pinned[module.__name__] = module
    try:
        yield
    finally:
        if previous is None:
            del _pinned[module.__name__]
        else:
            _pinned[module.__name__] = previous


def _execute(path: Path, name: str, data: bytes) -> ModuleType:
    """Run ``data`` (the source of ``path``) as module ``name``; failures, ``sys.exit()`` included,
    are one ModelFileError."""
    spec = importlib.util.spec_from_loader(name, loader=None, origin=str(path))
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__file__ = str(path)
    module.__fxpipe_sha256__ = hashlib.sha256(data).hexdigest()  # type: ignore[attr-defined]
    previous = sys.modules.get(name)
    sys.modules[name] = module
    try:
        with (
            exits_raise()
        ):  # os._exit() at import is an error, not a silent exit 0 (Note [os._exit in user code])
            exec(compile(data, str(path), "exec"), module.__dict__)  # noqa: S102 - the user's own model file
    except BaseException as exc:
        if previous is None:
            del sys.modules[name]
        else:
            sys.modules[name] = previous
        if isinstance(exc, KeyboardInterrupt):
            raise
        raise ModelFileError(
            f"importing {path.name} failed: {_describe(exc)}{_beside(exc, path)}"
        ) from exc
    return module


def _beside(exc: BaseException, path: Path) -> str:
    """For a module the model file imports that is not installed but lies beside it or in the
    current directory: why it is not found and what to do (Note [isolated workers] in
    ``fxpipe.runtime.launch.isolation``: a rank imports the build's files and installed packages)."""
    if not isinstance(exc, ModuleNotFoundError) or not exc.name:
        return ""
    top = exc.name.split(".")[0]
    for folder in dict.fromkeys((path.parent, Path.cwd())):
        for found in (folder / f"{top}.py", folder / top / "__init__.py"):
            if found.is_file():
                shown = found if found.name != "__init__.py" else found.parent
                return (
                    f" ({shown} is beside it, but fxpipe's ranks import only the build's checked "
                    "files and installed packages, not modules found beside the model file or in the "
                    f"current directory); define what {path.name} needs from {top} in {path.name} "
                    f"itself, install {top} as a package (pip install -e), or name its folder in an "
                    f"absolute PYTHONPATH (PYTHONPATH={shown.parent.resolve()})"
                )
    return ""


def _describe(exc: BaseException) -> str:
    if isinstance(exc, SystemExit):
        return f"it called sys.exit({exc.code!r}); a model file must define functions, not end the program"
    if isinstance(exc, ExitCalled):
        return f"it called os._exit({exc.code!r}); a model file must define functions, not end the program"
    return f"{type(exc).__name__}: {exc}"


@dataclass
class ModelSource:
    """A loaded model file and the functions it provides."""

    path: Path
    module: ModuleType
    model_fn: str = "build_model"
    inputs_fn: str = "example_inputs"
    targets_fn: str = "example_targets"
    loss_fn_name: str = "loss_fn"

    @property
    def sha256(self) -> str:
        """The sha256 of the bytes the module was imported from (of the file now, if unknown)."""
        return getattr(self.module, "__fxpipe_sha256__", None) or file_sha256(self.path)

    def _call(self, name: str, *args: Any) -> Any:
        fn = getattr(self.module, name, None)
        if not callable(fn):
            raise ModelFileError(f"{self.path.name} defines no function {name}()")
        try:
            with exits_raise():
                return fn(*args)
        except (Exception, SystemExit, ExitCalled) as exc:
            raise ModelFileError(f"{self.path.name}:{name}() raised {_describe(exc)}") from exc

    def build_model(self) -> Any:
        import torch.nn as nn

        model = self._call(self.model_fn)
        if not isinstance(model, nn.Module):
            raise ModelFileError(
                f"{self.path.name}:{self.model_fn}() returned {type(model).__name__}, expected a torch.nn.Module"
            )
        return model

    def example_call(self, batch_size: int) -> ModelInputs:
        """The example inputs function's call on ``batch_size`` samples (see the module docstring)."""
        from fxpipe.model_inputs import parse_model_inputs

        value = self._call(self.inputs_fn, batch_size)
        try:
            return parse_model_inputs(value)
        except ValueError as exc:
            raise ModelFileError(
                f"{self.path.name}:{self.inputs_fn}({batch_size}): {exc}"
            ) from None

    def example_inputs(self, batch_size: int) -> tuple[Any, ...]:
        """The positional arguments of ``example_call``, for model files that pass no keyword arguments."""
        call = self.example_call(batch_size)
        if call.kwargs:
            raise ModelFileError(
                f"{self.path.name}:{self.inputs_fn}({batch_size}) passes keyword arguments "
                f"({', '.join(call.kwargs)}); use ModelSource.example_call for the whole call"
            )
        return call.args

    def dynamic_dims(self) -> dict[str, dict[int, Any]] | None:
        """The model file's ``dynamic_dims()`` (input name -> dimension -> symbol), if it defines one
        (Note [dynamic dimensions] in ``fxpipe.tracer.dynamic``)."""
        if not self.has("dynamic_dims"):
            return None
        value = self._call("dynamic_dims")
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            raise ModelFileError(
                f"{self.path.name}:dynamic_dims() returned {type(value).__name__}; return a dict "
                'such as {"input_ids": {1: "seq"}} (input name -> dimension -> symbol)'
            )
        return value

    def has(self, name: str) -> bool:
        return callable(getattr(self.module, name, None))

    def example_targets(self, batch_size: int) -> Any:
        return self._call(self.targets_fn, batch_size)

    @property
    def has_loss_fn(self) -> bool:
        """Whether the file defines a loss function (else training uses the model's own ``output.loss``)."""
        return self.has(self.loss_fn_name)

    @property
    def loss_fn(self) -> Callable[..., Any]:
        fn = getattr(self.module, self.loss_fn_name, None)
        if not callable(fn):
            raise ModelFileError(
                f"{self.path.name} defines no {self.loss_fn_name}(output, target); training needs one"
            )
        return fn


def load_model_file(
    spec: str | Path,
    model_fn: str | None = None,
    inputs_fn: str | None = None,
    *,
    data: bytes | None = None,
) -> ModelSource:
    """Load ``path.py`` or ``path.py:model_fn`` and check that its functions exist.

    ``data``: the file's bytes, already checked (``import_model_bytes``); the file is not read.
    """
    text = str(spec)
    inline_fn = None
    if ":" in text and not Path(text).is_file():
        text, inline_fn = text.rsplit(":", 1)
    path = Path(text)
    if path.suffix != ".py":
        raise ModelFileError(f"model file {text!r} must be a .py file")
    source = ModelSource(
        path=path.resolve(),
        module=import_model_module(path) if data is None else import_model_bytes(path, data),
        model_fn=model_fn or inline_fn or "build_model",
        inputs_fn=inputs_fn or "example_inputs",
    )
    for name in (source.model_fn, source.inputs_fn):
        if not source.has(name):
            raise ModelFileError(
                f"{path.name} defines no function {name}(); see the model-file contract in docs/model-file.md"
            )
    return source
