"""The options of the verbs that work on a checkpoint without starting a job.

``ExportOptions``: ``fxpipe export D`` (the model's state dict as safetensors, and with
``--pretrained DIR`` also ``save_pretrained``'s layout of a transformers model);
``ConvertOptions``: ``fxpipe checkpoint convert OLD NEW`` (per-rank files into the model-keyed
format, Note [converting per-rank checkpoints] in ``fxpipe.runtime.train.convert``). Declared
once (Note [options declared once] in ``fxpipe.optionspec``); imports no torch: the CLI builds
its parsers from them at start-up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fxpipe.optionspec import Options, option

__all__ = ["ConvertOptions", "ExportOptions"]


@dataclass(frozen=True, kw_only=True)
class ExportOptions(Options):
    """What ``fxpipe export`` writes besides the plain safetensors file."""

    what: ClassVar[str] = "export options"

    pretrained: str | None = option(
        None,
        metavar="DIR",
        none_means="only --out",
        help="also write save_pretrained's layout (config.json + model.safetensors, loadable by "
        "from_pretrained) of a transformers model into this new directory",
    )
    model: str | None = option(
        None,
        metavar="PATH",
        none_means="the model file the checkpoint was trained from",
        help="with --pretrained: the model file (path.py or path.py:build_fn) whose model gives "
        "the config",
    )


@dataclass(frozen=True, kw_only=True)
class ConvertOptions(Options):
    """What ``fxpipe checkpoint convert`` reads besides the old checkpoint."""

    what: ClassVar[str] = "checkpoint convert options"

    build: str | None = option(
        None,
        metavar="BUILD",
        help="required: the build directory whose run wrote the per-rank checkpoint (its stages name the "
        "optimizer's parameters and the tied weights)",
    )
