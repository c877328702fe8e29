"""Check a build directory against its manifest before anything of it is read, imported or run.

Note [check before use]: every file a build depends on (the model file, each stage's
source and weights, the classes several stages share, ``plan.json``) has its sha256 in ``manifest.json``. ``check_build``
opens each one without blocking (a FIFO or device in its place is refused, never waited
on), hashes it and compares, before a byte of it is parsed, imported or executed. Source
files, the model file and ``plan.json`` are kept as the very bytes that were hashed, so
what runs is what was checked and the file is never read again. Weights are hashed as a
stream (they can be large) and read afterwards by ``load_weights``, which refuses a file
whose identity (device, inode, size, modification time) changed since it was hashed and
checks the safetensors header itself before safetensors parses it; any failure reading
them is one ``BuildDirError``. The manifest is the root of trust: it is validated
(``fxpipe.schema``), not hashed.

Example::

    build = check_build("build", stages=[1])      # the model file, plan.json and stage 1's files
    source = build.model_source()                 # the model file imported from its checked bytes
    tensors = build.load_weights(1, device="cpu")
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from fxpipe.codegen.manifest import Manifest
from fxpipe.errors import BuildDirError
from fxpipe.userfiles import open_regular, shown

if TYPE_CHECKING:
    import torch

    from fxpipe.modelfile import ModelSource
    from fxpipe.partitioner import PartitionPlan

__all__ = [
    "CheckedFile",
    "CheckedBuild",
    "check_build",
    "check_shared",
    "read_checked_file",
    "model_import_needed",
    "TorchVersionWarning",
    "warn_if_other_torch",
]

_MAX_HEADER = 100 << 20  # safetensors refuses larger headers too
_BLOCK = 1 << 20
_REBUILD = "rebuild the directory with `fxpipe partition`"


@dataclass(frozen=True)
class CheckedFile:
    """A file whose sha256 matched the manifest: its bytes (``None`` for weights, read later)
    and its identity when hashed (device, inode, size, modification time in ns)."""

    path: Path
    sha256: str
    data: bytes | None
    identity: tuple[int, int, int, int]


def _open_regular(path: Path, what: str) -> int:
    """A read-only descriptor of ``path``, refused unless it is a regular file; never blocks."""
    try:
        return open_regular(
            path, what, BuildDirError, _REBUILD
        )  # Note [regular files only] in fxpipe.userfiles
    except FileNotFoundError:
        raise BuildDirError(f"{what} {str(path)!r} is missing; {_REBUILD}") from None


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def read_checked_file(
    path: str | Path, expected: str, what: str, *, keep: bool = True
) -> CheckedFile:
    """Hash ``path`` and refuse it unless its sha256 is ``expected``; ``keep``: return its bytes too.

    ``what`` names the file in messages ("stage source", "model file", ...).
    """
    path = Path(path)
    fd = _open_regular(path, what)
    h, chunks = hashlib.sha256(), []
    try:
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            for block in iter(lambda: f.read(_BLOCK), b""):
                h.update(block)
                if keep:
                    chunks.append(block)
    except OSError as exc:
        raise BuildDirError(f"cannot read {what} {str(path)!r}: {exc.strerror or exc}") from None
    actual = h.hexdigest()
    if actual != expected:
        raise BuildDirError(
            f"{what} {path.name} has sha256 {actual[:12]}…, but manifest.json expects "
            f"{expected[:12]}…: the file changed after it was built; rebuild with `fxpipe partition`"
        )
    return CheckedFile(path, actual, b"".join(chunks) if keep else None, _identity(st))


@dataclass(frozen=True)
class CheckedBuild:
    """A build directory whose manifest was read and whose files (those asked for) matched it."""

    build_dir: Path
    manifest: Manifest
    model: CheckedFile | None
    plan: CheckedFile | None
    sources: Mapping[int, CheckedFile]
    weights: Mapping[int, CheckedFile]
    shared: CheckedFile | None = None  # the shared classes, when a checked stage imports them

    def model_module(self) -> ModuleType:
        """The model file, imported from its checked bytes (see ``fxpipe.modelfile.import_model_bytes``)."""
        from fxpipe.modelfile import import_model_bytes

        model = self._model()
        assert model.data is not None
        return import_model_bytes(model.path, model.data)

    def model_source(self) -> ModelSource:
        """The model file's ``ModelSource`` (functions named as in the manifest), imported from its checked bytes."""
        from fxpipe.modelfile import load_model_file

        model, m = self._model(), self.manifest
        return load_model_file(
            model.path, model_fn=m.model_fn or None, inputs_fn=m.inputs_fn or None, data=model.data
        )

    def read_plan(self) -> PartitionPlan | None:
        """``plan.json`` parsed from its checked bytes (``None`` when the build has none)."""
        from fxpipe.errors import PartitionError
        from fxpipe.partitioner import PartitionPlan

        if self.plan is None:
            return None
        assert self.plan.data is not None
        try:
            return PartitionPlan.from_json(self.plan.data.decode("utf-8", errors="replace"))
        except PartitionError as exc:
            raise BuildDirError(f"{self.plan.path}: {exc}; {_REBUILD}") from None

    def source(self, index: int) -> CheckedFile:
        if index not in self.sources:
            raise KeyError(f"stage {index}'s source was not checked")
        return self.sources[index]

    def load_weights(
        self, index: int, device: str | torch.device = "cpu"
    ) -> dict[str, torch.Tensor]:
        """Stage ``index``'s tensors from its checked weights file (Note [check before use])."""
        checked = self.weights[index]
        return _load_safetensors(checked, str(device))

    @classmethod
    def from_memory(
        cls, files: Mapping[str, bytes], stages: Iterable[int], where: str | Path
    ) -> CheckedBuild:
        """A build held in memory (file name -> bytes: ``manifest.json``, ``plan.json`` and the given
        stages' files), checked against its manifest like a directory; ``where`` is the folder the
        files are said to be in (tracebacks name the stage sources there). Nothing touches the disk."""
        where = Path(where)
        if "manifest.json" not in files:
            raise BuildDirError("a build in memory without manifest.json")
        manifest = Manifest.from_json(files["manifest.json"].decode("utf-8", errors="replace"))

        def check(name: str, expected: str, what: str) -> CheckedFile:
            if name not in files:
                raise BuildDirError(f"{what} {name} is missing from the build")
            data = files[name]
            actual = hashlib.sha256(data).hexdigest()
            if actual != expected and (
                expected or what != "plan"
            ):  # an older build records no plan hash
                raise BuildDirError(
                    f"{what} {name} has sha256 {actual[:12]}…, but manifest.json expects "
                    f"{expected[:12]}…"
                )
            return CheckedFile(where / name, actual, data, (0, 0, len(data), 0))

        plan = check("plan.json", manifest.plan_sha256, "plan") if "plan.json" in files else None
        sources, tensors = {}, {}
        for i in stages:
            sm = manifest.stage(i)
            sources[i] = check(sm.source, sm.source_sha256, "stage source")
            tensors[i] = check(sm.weights, sm.weights_sha256, "stage weights")
        shared = None
        if any(manifest.stage(i).imports_shared for i in sources):
            shared = check(manifest.shared_source, manifest.shared_sha256, "shared classes")
        return cls(where, manifest, None, plan, sources, tensors, shared)

    def _model(self) -> CheckedFile:
        if self.model is None:
            raise BuildDirError(f"{self.build_dir}/manifest.json names no model file")
        return self.model


def check_build(
    build_dir: str | Path,
    stages: Iterable[int] | None = None,
    *,
    model: bool = True,
    plan: bool = True,
    weights: bool = True,
    manifest: Manifest | None = None,
) -> CheckedBuild:
    """Read ``build_dir``'s manifest and check the files asked for against it (Note [check before use]).

    ``stages``: the stages whose source (and, with ``weights``, weights) to check, with the shared
    classes when one of them imports them; ``None``: all. ``model``: check the model file (an error if the manifest names none, or names one
    without its sha256). ``plan``: check ``plan.json`` when there is one (a build written
    before plan.json was hashed has no ``plan_sha256``: its plan is read unhashed, but still
    validated). ``manifest``: the manifest, already read.
    """
    build_dir = Path(build_dir)
    manifest = manifest if manifest is not None else Manifest.from_json(build_dir)
    warn_if_other_torch(manifest, build_dir)
    indices = (
        range(manifest.num_stages) if stages is None else [manifest.stage(i).index for i in stages]
    )
    model_file = None
    if model:
        if not manifest.model_file:
            raise BuildDirError(f"{build_dir}/manifest.json names no model file; it is needed here")
        if not manifest.model_sha256:
            raise BuildDirError(
                f"{build_dir}/manifest.json names the model file {manifest.model_file!r} but "
                f"records no sha256 for it, so it cannot be checked; {_REBUILD}"
            )
        model_file = read_checked_file(
            manifest.model_path(build_dir), manifest.model_sha256, "model file"
        )
    plan_file = None
    plan_path = build_dir / "plan.json"
    if plan and (manifest.plan_sha256 or plan_path.exists() or plan_path.is_symlink()):
        if manifest.plan_sha256:
            plan_file = read_checked_file(plan_path, manifest.plan_sha256, "plan")
        else:  # an older build: nothing to compare with, but never block on it
            fd = _open_regular(plan_path, "plan")
            with os.fdopen(fd, "rb") as f:
                data = f.read()
            plan_file = CheckedFile(
                plan_path, hashlib.sha256(data).hexdigest(), data, _identity(os.stat(plan_path))
            )
    sources, tensors = {}, {}
    for i in indices:
        sm = manifest.stages[i]
        sources[i] = read_checked_file(build_dir / sm.source, sm.source_sha256, "stage source")
        if weights:
            tensors[i] = read_checked_file(
                build_dir / sm.weights, sm.weights_sha256, "stage weights", keep=False
            )
    shared = None
    if any(manifest.stages[i].imports_shared for i in indices):
        shared = read_checked_file(
            build_dir / manifest.shared_source, manifest.shared_sha256, "shared classes"
        )
    return CheckedBuild(build_dir, manifest, model_file, plan_file, sources, tensors, shared)


def check_shared(build_dir: str | Path) -> CheckedFile:
    """``build_dir``'s shared classes, checked against its manifest (Note [classes several stages share])."""
    build_dir = Path(build_dir)
    manifest = Manifest.from_json(build_dir)
    if not manifest.shared_source:
        raise BuildDirError(f"{build_dir}/manifest.json names no shared classes; {_REBUILD}")
    return read_checked_file(
        build_dir / manifest.shared_source, manifest.shared_sha256, "shared classes"
    )


class TorchVersionWarning(UserWarning):
    """A build is used under another torch release than the one that built it."""


def warn_if_other_torch(manifest: Manifest, build_dir: str | Path) -> None:
    """Warn (``TorchVersionWarning``) when ``build_dir`` was built by another torch release (its local
    part, ``+cpu``, aside): its stages' code was emitted for the operators of that release."""
    import torch

    built, here = manifest.torch_version.split("+")[0], torch.__version__.split("+")[0]
    if built and built != here:
        warnings.warn(
            f"fxpipe: {shown(build_dir)} was built with torch {built}, this is torch {here}; its stages' "
            "code was emitted for the other release: if loading, verify or training fails, rebuild it "
            "with `fxpipe partition`",
            TorchVersionWarning,
            stacklevel=3,
        )


def _load_safetensors(checked: CheckedFile, device: str) -> dict[str, torch.Tensor]:
    """The tensors of a checked safetensors file, read from the same file that was hashed."""
    from safetensors.torch import load, load_file

    what = f"stage weights {checked.path.name}"
    if checked.data is not None:  # held in memory (CheckedBuild.from_memory)
        return _load_safetensors_bytes(checked.data, device, what)
    fd = _open_regular(checked.path, "stage weights")
    try:
        if _identity(os.fstat(fd)) != checked.identity:
            raise BuildDirError(f"{what} changed while it was being loaded; {_REBUILD}")
        size = checked.identity[2]
        _check_header(fd, size, what)
        proc = Path(f"/proc/self/fd/{fd}")
        try:
            if (
                proc.exists()
            ):  # the very file that was checked, even if its name now points elsewhere
                return load_file(str(proc), device=device)
            with os.fdopen(os.dup(fd), "rb") as f:
                return {k: v.to(device) for k, v in load(f.read()).items()}
        except BuildDirError:
            raise
        except (
            Exception
        ) as exc:  # safetensors' SafetensorError, a bad dtype, a device that does not exist
            raise BuildDirError(
                f"cannot read {what}: {type(exc).__name__}: {exc}; {_REBUILD}"
            ) from None
    finally:
        os.close(fd)


def _load_safetensors_bytes(data: bytes, device: str, what: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    _check_header_bytes(data[:8], lambda n: data[8 : 8 + n], len(data), what)
    try:
        return {k: v.to(device) for k, v in load(data).items()}
    except Exception as exc:
        raise BuildDirError(
            f"cannot read {what}: {type(exc).__name__}: {exc}; {_REBUILD}"
        ) from None


def _check_header(fd: int, size: int, what: str) -> None:
    _check_header_bytes(os.pread(fd, 8, 0), lambda n: os.pread(fd, n, 8), size, what)


def _check_header_bytes(head: bytes, read: Callable[[int], bytes], size: int, what: str) -> None:
    """Refuse a safetensors file whose header is missing, larger than the file (or than 100 MiB), or not a JSON
    object of tensors lying inside the file."""
    if len(head) < 8:
        raise BuildDirError(f"{what} has no safetensors header ({size} bytes); {_REBUILD}")
    n = int.from_bytes(head, "little")
    if n > min(size - 8, _MAX_HEADER):
        raise BuildDirError(
            f"{what}: its safetensors header claims {n} bytes, but the file has {size}; {_REBUILD}"
        )
    try:
        header = json.loads(read(n))
    except (ValueError, UnicodeDecodeError) as exc:
        raise BuildDirError(
            f"{what}: its safetensors header is not valid JSON ({exc}); {_REBUILD}"
        ) from None
    if not isinstance(header, dict):
        raise BuildDirError(f"{what}: its safetensors header is not a JSON object; {_REBUILD}")
    data = size - 8 - n
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data
        ):
            raise BuildDirError(
                f"{what}: tensor {key!r} lies outside the file ({offsets!r}, {data} data bytes); "
                f"{_REBUILD}"
            )


def model_import_needed(manifest: Manifest, stages: Iterable[int]) -> bool:
    """Whether any of ``stages`` imports user classes from the build's model file (a build made
    in-process from a module, with no model file, imports them from modules already loaded)."""
    return bool(manifest.model_file) and any(manifest.stage(i).imports_model_file for i in stages)
