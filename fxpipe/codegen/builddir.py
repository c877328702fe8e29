"""Replace a build directory as a whole: write the new build beside it, swap it in when complete.

Note [build directory swap]: a build is written into a hidden sibling
(``.<name>.tmp-<pid>-<random>``, in the same folder, so paths relative to the build
directory are the same there) and renamed into place only once every file is
written (and, for ``write_build_dir``, checked against the model: Note [safety net] in
``fxpipe.codegen.check.safety``). A failure part-way (an error, a full disk, a refused check)
removes the sibling and leaves the previous build byte-identical; a successful write drops every file of the
previous build, so no stale ``stage_3.py`` of a 4-stage build outlives a 2-stage
one. The swap is two renames (old aside, new in) followed by removing the old
build. An existing directory is replaced only if it is empty, or a build directory
(it holds a ``manifest.json`` that this fxpipe reads) that holds nothing but what fxpipe
writes into one, so neither ``--out .`` nor a folder of the user's ``report.html`` and
``profile.json`` is ever deleted.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
from pathlib import Path
from typing import Iterator

from fxpipe.errors import BuildDirError

__all__ = ["check_build_target", "staged_build_dir", "replace_file", "normalize_modes"]

# What fxpipe writes into a build directory: the build itself, and run.json of `fxpipe run`.
_BUILD_FILES = re.compile(
    r"(manifest|plan|profile|run|tp_plan)\.json|report\.html|stage_\d+\.(py|safetensors)|shared\.py"
    r"|__pycache__"
)


def _target(out_dir: str | Path) -> Path:
    out = Path(out_dir).absolute()
    return out.resolve() if out.is_symlink() else out


def check_build_target(out_dir: str | Path) -> Path:
    """The directory a build may be written to, or a BuildDirError that says why not.

    Refused: a path that is a file, a folder that is not writable, and an existing
    folder that holds anything fxpipe did not write there (Note [build directory swap]).
    """
    out = _target(out_dir)
    if out.exists() and not out.is_dir():
        raise BuildDirError(
            f"--out {str(out_dir)!r} is a file, not a directory; choose a directory for the build"
        )
    if out.is_dir():
        entries = sorted(p.name for p in out.iterdir())
        foreign = [name for name in entries if not _BUILD_FILES.fullmatch(name)]
        if foreign:
            raise BuildDirError(
                f"--out {str(out_dir)!r} holds files that are not part of an fxpipe build "
                f"({', '.join(foreign[:5])}{', ...' if len(foreign) > 5 else ''}); a build replaces "
                "its directory as a whole, so choose a new or empty directory"
            )
        if entries:
            _check_is_build(out, out_dir)
        if not os.access(out, os.W_OK | os.X_OK):
            raise BuildDirError(
                f"the build directory {str(out)!r} is not writable; choose another --out"
            )
    parent = next((p for p in out.parents if p.exists()), None)
    if parent is not None and (not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK)):
        raise BuildDirError(
            f"cannot create the build directory {str(out)!r}: {str(parent)!r} is "
            f"{'not a directory' if not parent.is_dir() else 'not writable'}; choose another --out"
        )
    return out


def _check_is_build(out: Path, out_dir: str | Path) -> None:
    """Refuse a non-empty folder that is not a build this fxpipe wrote (its manifest is missing or unreadable)."""
    from fxpipe.codegen.manifest import Manifest

    try:
        Manifest.from_json(out / "manifest.json")
    except BuildDirError as exc:
        what = (
            "has no manifest.json"
            if not (out / "manifest.json").exists()
            else f"has a manifest it cannot read ({exc})"
        )
        raise BuildDirError(
            f"--out {str(out_dir)!r} is not empty and {what}, so it is not a build fxpipe wrote; "
            "a build replaces its directory as a whole, so choose a new or empty directory"
        ) from None


@contextlib.contextmanager
def staged_build_dir(out_dir: str | Path) -> Iterator[Path]:
    """Yield an empty sibling folder of ``out_dir`` to write a build into; on a clean exit it
    replaces ``out_dir`` (Note [build directory swap]). ``OSError`` becomes one BuildDirError line.

    Example::

        with staged_build_dir("build") as tmp:
            (tmp / "manifest.json").write_text(text)
    """
    out = check_build_target(out_dir)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = _sibling(out, "tmp")
        os.mkdir(tmp)
    except OSError as exc:
        raise BuildDirError(
            f"cannot write the build directory {str(out)!r}: {_reason(exc)}"
        ) from None
    try:
        yield tmp
        normalize_modes(tmp)
        _swap(tmp, out)
    except OSError as exc:
        raise BuildDirError(
            f"writing the build directory {str(out)!r} failed, the previous build (if any) is "
            f"unchanged: {_reason(exc)}"
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def normalize_modes(folder: Path) -> None:
    """Give every file in ``folder`` the mode a plain ``open()`` would (``0o666`` less the umask): safetensors
    writes its files ``0600``, so a build's weights could not be read by the users its sources can."""
    mask = os.umask(0)
    os.umask(mask)
    for path in folder.rglob("*"):
        if path.is_file() and not path.is_symlink():
            os.chmod(path, 0o666 & ~mask)


def _sibling(out: Path, kind: str) -> Path:
    return out.parent / f".{out.name}.{kind}-{os.getpid()}-{secrets.token_hex(4)}"


def _swap(new: Path, out: Path) -> None:
    """Rename ``new`` to ``out``; an existing ``out`` is moved aside first and removed after."""
    if not out.exists():
        os.rename(new, out)
        return
    old = _sibling(out, "old")
    os.rename(out, old)
    try:
        os.rename(new, out)
    except OSError:
        os.rename(old, out)
        raise
    shutil.rmtree(old, ignore_errors=True)


def replace_file(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all (a sibling temporary file, then ``os.replace``)."""
    target = Path(path)
    tmp = _sibling(target, "tmp")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, target)
    except OSError as exc:
        raise BuildDirError(f"cannot write {str(target)!r}: {_reason(exc)}") from None
    finally:
        tmp.unlink(missing_ok=True)


def _reason(exc: OSError) -> str:
    where = f": {exc.filename!r}" if exc.filename else ""
    return f"{exc.strerror or exc}{where}"
