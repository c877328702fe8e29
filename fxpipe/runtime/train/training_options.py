"""``TrainingOptions``: optimizer, schedule, clipping, data, eval, checkpoints and logs of a run.

A nested group of ``RunOptions`` (``RunOptions.training``): its fields declare the flags of
``fxpipe run`` and the JSON the workers read (Note [options declared once] in
``fxpipe.optionspec``). Imports no torch: the CLI builds its parser from it at start-up.
``fxpipe.runtime.train.optim`` turns the optimizer fields into ``torch.optim`` objects.

>>> TrainingOptions.from_dict(TrainingOptions(optimizer="adamw", betas=(0.9, 0.95)).to_dict()).betas
(0.9, 0.95)
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

from fxpipe.errors import ConfigError
from fxpipe.optionspec import Options, option, same_as
from fxpipe.partitioner.cost import (
    PRECISIONS,
)  # RunOptions.precision (fxpipe.runtime.pipeline.precision)
from fxpipe.partitioner.plan_options import PlanOptions

__all__ = ["TrainingOptions", "OPTIMIZERS", "LR_SCHEDULES", "PRECISIONS", "parse_betas"]

OPTIMIZERS = ("sgd", "adam", "adamw")
LR_SCHEDULES = ("constant", "linear", "cosine")


def parse_betas(text: str) -> tuple[float, float]:
    """``"0.9,0.95"`` -> ``(0.9, 0.95)`` (the ``--betas`` flag)."""
    parts = text.replace(" ", "").split(",")
    try:
        b1, b2 = (float(p) for p in parts)
    except ValueError:
        raise ConfigError(f"--betas wants two numbers like 0.9,0.999, got {text!r}") from None
    return b1, b2


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any, least: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


@dataclass(frozen=True, kw_only=True)
class TrainingOptions(Options):
    """How each rank's stage is trained (the learning rate itself is ``RunOptions.lr``).

    ``optimizer`` (torch.optim's SGD, Adam or AdamW) with ``weight_decay`` and, for Adam(W),
    ``betas``; the learning rate rises linearly over ``warmup_steps`` then follows
    ``lr_schedule``. ``clip_grad_norm``: clip the global gradient norm of the whole pipeline
    to it. ``data``: ``path.py:function`` yielding ``(inputs, targets)`` batches (default: the
    model file's ``train_batches`` if it has one, else its example batch every step);
    ``eval_every`` steps, ``eval_steps`` batches of ``eval_data`` (default: the model file's
    ``eval_batches``). ``checkpoint_dir`` gets a checkpoint every ``checkpoint_every`` steps
    (and after the last); ``resume`` continues from it. ``log_every``: steps per log line;
    ``tensorboard``: a directory for TensorBoard event files (``fxpipe.runtime.train.log``).
    """

    what: ClassVar[str] = "training options"

    # PlanOptions' --optimizer (declared once), which the plan prices by its state; a run names
    # the torch.optim class
    optimizer: str = same_as(
        PlanOptions,
        "optimizer",
        choices=OPTIMIZERS,
        help="torch.optim optimizer of every stage: %(choices)s",
    )
    weight_decay: float = option(0.0, metavar="WD", help="weight decay (AdamW: decoupled)")
    betas: tuple[float, float] = option(
        (0.9, 0.999), parse=parse_betas, metavar="B1,B2", help="Adam(W) betas, as B1,B2"
    )
    warmup_steps: int = option(0, metavar="K", help="steps of linear learning-rate warm-up")
    lr_schedule: str = option(
        "constant",
        choices=LR_SCHEDULES,
        metavar="NAME",
        help="learning rate after the warm-up: %(choices)s",
    )
    clip_grad_norm: float | None = option(
        None,
        metavar="X",
        none_means="no clipping",
        help="clip the global gradient norm over all stages to X",
    )
    data: str | None = option(
        None,
        metavar="FILE:FN",
        none_means="the model file's train_batches, else its example batch",
        help="training batches: path.py:function(batch_size, rank_info) yielding (inputs, targets)",
    )
    eval_data: str | None = option(
        None,
        metavar="FILE:FN",
        none_means="the model file's eval_batches, else --data's batches",
        help="evaluation batches, as --data",
    )
    eval_every: int | None = option(
        None,
        metavar="N",
        none_means="never",
        help="evaluate every N steps (forward only, eval mode)",
    )
    eval_steps: int = option(1, metavar="K", help="batches per evaluation")
    checkpoint_dir: str | None = option(
        None,
        metavar="DIR",
        none_means="no checkpoints",
        help="where checkpoints are written (and read with --resume)",
    )
    checkpoint_every: int | None = option(
        None,
        metavar="N",
        none_means="only after the last step",
        help="steps between checkpoints (one is written after the last step too)",
    )
    resume: bool = option(False, help="continue from the checkpoint in --checkpoint-dir")
    resume_from: str | None = option(
        None,
        metavar="DIR",
        none_means="none",
        help="continue from the checkpoint in DIR, written by any layout of this model (other "
        "stages, schedule, replicas or sharding, the same global batch); new checkpoints go to "
        "--checkpoint-dir",
    )
    log_every: int = option(1, metavar="N", help="steps per log line")
    tensorboard: str | None = option(
        None,
        metavar="DIR",
        none_means="none",
        help="write TensorBoard event files (loss, lr, ...) into DIR",
    )

    def __post_init__(self) -> None:
        if isinstance(self.betas, list):
            object.__setattr__(self, "betas", tuple(self.betas))
        if self.optimizer not in OPTIMIZERS:
            raise ConfigError(
                f"--optimizer must be one of {list(OPTIMIZERS)}, got {self.optimizer!r}"
            )
        if self.lr_schedule not in LR_SCHEDULES:
            raise ConfigError(
                f"--lr-schedule must be one of {list(LR_SCHEDULES)}, got {self.lr_schedule!r}"
            )
        if not _number(self.weight_decay) or self.weight_decay < 0:
            raise ConfigError(f"--weight-decay must be a number >= 0, got {self.weight_decay!r}")
        if (
            not isinstance(self.betas, tuple)
            or len(self.betas) != 2
            or not all(_number(b) and 0 <= b < 1 for b in self.betas)
        ):
            raise ConfigError(
                f"--betas must be two numbers in [0, 1), like 0.9,0.999; got {self.betas!r}"
            )
        if not _count(self.warmup_steps, 0):
            raise ConfigError(f"--warmup-steps must be an int >= 0, got {self.warmup_steps!r}")
        if self.clip_grad_norm is not None and (
            not _number(self.clip_grad_norm) or self.clip_grad_norm <= 0
        ):
            raise ConfigError(
                f"--clip-grad-norm must be a number > 0, got {self.clip_grad_norm!r}; leave it out "
                "to train without clipping"
            )
        for flag, spec in (("--data", self.data), ("--eval-data", self.eval_data)):
            if spec is not None and (not isinstance(spec, str) or ":" not in spec):
                raise ConfigError(f"{flag} must be path.py:function, got {spec!r}")
        for flag, value in (
            ("--eval-every", self.eval_every),
            ("--checkpoint-every", self.checkpoint_every),
        ):
            if value is not None and not _count(value, 1):
                raise ConfigError(f"{flag} must be an int >= 1 (steps), got {value!r}")
        if not _count(self.eval_steps, 1):
            raise ConfigError(
                f"--eval-steps must be an int >= 1 (batches per evaluation), got {self.eval_steps!r}"
            )
        if not _count(self.log_every, 1):
            raise ConfigError(
                f"--log-every must be an int >= 1 (steps per log line), got {self.log_every!r}"
            )
        if self.checkpoint_dir is None and (self.checkpoint_every is not None or self.resume):
            flag = "--resume" if self.resume else "--checkpoint-every"
            raise ConfigError(
                f"{flag} needs --checkpoint-dir DIR (where checkpoints are written and read)"
            )
        if self.tensorboard is not None and (
            not isinstance(self.tensorboard, str) or not self.tensorboard
        ):
            raise ConfigError(f"--tensorboard must be a directory, got {self.tensorboard!r}")
        if not isinstance(self.resume, bool):
            raise ConfigError(f"resume must be true or false, got {self.resume!r}")
        if self.resume_from is not None and (
            not isinstance(self.resume_from, str) or not self.resume_from
        ):
            raise ConfigError(f"--resume-from must be a directory, got {self.resume_from!r}")
        if self.resume_from is not None and self.resume:
            raise ConfigError(
                "--resume and --resume-from both name a checkpoint to continue; give one "
                "(--resume reads --checkpoint-dir)"
            )
