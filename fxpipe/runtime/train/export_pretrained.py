"""``fxpipe export D --pretrained DIR``: a checkpoint's transformers model in ``save_pretrained``'s layout.

Note [exporting a transformers model]: a checkpoint holds tensors only; the config that
``from_pretrained`` needs is the model's. The model file the checkpoint was trained from
(``meta.build.model_file``, or ``--model``) builds the model on the meta device, so nothing is
allocated or initialised, and ``save_pretrained(DIR, state_dict=...)`` writes its
``config.json`` (and ``generation_config.json``) beside ``model.safetensors`` holding the
checkpoint's tensors. The state dict hands a tied tensor under all its names as one tensor
(``read_model_state``), so transformers' own rule for tied weights applies: it keeps the key it
keeps for its own models (``_tied_weights_keys``) and ``from_pretrained`` ties the others back.
A model file that is not the one trained (its sha256 differs from the record's), a model that
is not a ``PreTrainedModel``, or keys that differ from the checkpoint's are refused in one line.
``DIR`` is written whole or not at all: into a hidden sibling folder first, renamed into place.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

import torch

from fxpipe.errors import CheckpointError
from fxpipe.modelfile import file_sha256, load_model_file
from fxpipe.runtime.train.commit import new_token

__all__ = ["export_pretrained"]


def _model_file(meta: dict[str, Any], model: str | None, directory: Path) -> tuple[str, str | None]:
    """(the model file spec to load, its factory name) for ``--pretrained``."""
    build = dict(meta.get("build") or {})
    if model is not None:
        return model, None
    named = build.get("model_file")
    if not named or not Path(named).is_absolute() or not Path(named).is_file():
        raise CheckpointError(
            f"--pretrained needs the model file that gives the config: the checkpoint in "
            f"{directory} names {named!r}{' relative to its build' if named else ''}; give "
            "--model path.py"
        )
    if build.get("model_sha256") and file_sha256(named) != build["model_sha256"]:
        raise CheckpointError(
            f"--pretrained: {named} changed since the checkpoint in {directory} was trained from "
            "it; give --model with the model file it was trained from"
        )
    return named, build.get("model_fn")


def export_pretrained(
    directory: str | Path,
    state: dict[str, torch.Tensor],
    out: str | Path,
    meta: dict[str, Any],
    model: str | None = None,
) -> list[str]:
    """Write ``state`` (the checkpoint's model state dict, tied tensors shared) into the new
    directory ``out`` with ``save_pretrained`` of the model the model file builds (Note
    [exporting a transformers model]); returns the names of the files written."""
    from transformers import PreTrainedModel
    from transformers.utils import logging as hf_logging

    directory, target = Path(directory), Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise CheckpointError(
            f"--pretrained {str(out)!r} exists and is not an empty directory; name a new one"
        )
    spec, fn = _model_file(meta, model, directory)
    source = load_model_file(spec, fn)
    with torch.device("meta"):
        built = source.build_model()
    if not isinstance(built, PreTrainedModel):
        raise CheckpointError(
            f"--pretrained: {spec} builds a {type(built).__name__}, not a transformers "
            "PreTrainedModel; export it with --out (safetensors of its state dict) only"
        )
    want = set(built.state_dict())
    missing, extra = sorted(want - set(state)), sorted(set(state) - want)
    if missing or extra:
        raise CheckpointError(
            f"--pretrained: the checkpoint in {directory} does not fit {spec}'s model "
            f"(missing {missing[:3]}, unexpected {extra[:3]}); give --model with the model file "
            "it was trained from"
        )
    tied: dict[int, str] = {}
    shared = dict(state)
    for name, p in built.named_parameters(remove_duplicate=False):
        shared[name] = shared[tied.setdefault(id(p), name)]  # the model's ties, one tensor each
    tmp = target.parent / f".{target.name}.{new_token()}.fxpipe-tmp"
    bars = hf_logging.is_progress_bar_enabled()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        hf_logging.disable_progress_bar()
        built.save_pretrained(str(tmp), state_dict=shared, safe_serialization=True)
        os.replace(tmp, target)  # an empty directory is replaced too
    finally:
        if bars:
            hf_logging.enable_progress_bar()
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return sorted(p.name for p in target.iterdir())
