"""``save`` / ``load``: the seed's checkpoint functions, atomic and without pickled code.

``save(obj, f, partial=True)`` writes ``f"{f}_{mp_rank}"`` on every rank (each stage's
part); ``partial=False`` writes ``f`` once, from global rank 0 (call it on every rank
with the gathered ``state_dict()``s). A file is written to a temporary name in the
same folder and moved into place with ``os.replace``, so a crash never leaves a
truncated checkpoint. ``load`` uses ``torch.load(weights_only=True)``: tensors,
numbers, strings and containers load; a file that would run pickled code is refused.
"""

from __future__ import annotations

import os
import pickle
import tempfile
from pathlib import Path
from typing import Any

import torch

from fxpipe.errors import CheckpointError
from fxpipe.smp.state import current

__all__ = ["CheckpointError", "save", "load", "checkpoint_path"]


def checkpoint_path(f: str | os.PathLike[str], partial: bool) -> Path:
    """The file this rank reads or writes for ``f``."""
    return Path(f"{os.fspath(f)}_{current().mp_rank}") if partial else Path(f)


def save(obj: Any, f: str | os.PathLike[str], partial: bool = True, pickle_protocol: int = 2) -> None:
    """Save ``obj`` like ``torch.save``: per stage (``partial``) or once for the whole model.

    Example::

        fxpipe.save({"model_state_dict": model.local_state_dict()}, "ckpt.pt", partial=True)  # ckpt.pt_<mp_rank>
    """
    st = current()
    if not partial and st.rank != 0:
        return
    path = checkpoint_path(f, partial)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            torch.save(obj, out, pickle_protocol=pickle_protocol)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def load(f: str | os.PathLike[str], partial: bool = True, map_location: Any = None) -> Any:
    """Load what ``save`` wrote: this stage's file (``partial``) or the single full file.

    Example::

        checkpoint = fxpipe.load("ckpt.pt", partial=True)
        model.load_state_dict(checkpoint["model_state_dict"])
    """
    path = checkpoint_path(f, partial)
    if not path.is_file():
        hint = (f"was it saved with partial=True by a job with {current().layout.num_stages} partitions?" if partial
                else "was it saved with partial=False? a partial checkpoint's files end in _<mp_rank>")
        raise CheckpointError(f"checkpoint file {str(path)!r} does not exist; {hint}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        raise CheckpointError(f"{path} holds objects other than tensors and plain data ({first}); fxpipe loads "
                              "checkpoints with weights_only=True so they cannot run code. Save only state dicts, "
                              "tensors, numbers and strings") from None
    except (RuntimeError, EOFError, OSError) as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc}") from exc
