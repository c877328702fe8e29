"""``ModelTraceOptions``: how ``fxpipe trace`` and ``fxpipe partition`` build and trace a model file.

The fields are the one declaration of these options (Note [options declared once] in
``fxpipe.optionspec``): the verbs' flags and their help come from them, and
``trace_kwargs`` are ``trace_model_file``'s keyword arguments. Imports no torch: the CLI
builds its parsers from it at start-up.

>>> ModelTraceOptions(leaves=("Block",), trace_device="meta").trace_kwargs()["leaves"]
('Block',)
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from fxpipe.optionspec import Options, check_options, option
from fxpipe.tracer.measure.calibration import DEVICE_PRESETS

__all__ = [
    "ModelTraceOptions",
    "FRONTENDS",
    "TRACE_DEVICES",
    "DEFAULT_TRACE_CACHE_GIB",
    "default_cache_dir",
]

FRONTENDS = ("auto", "symbolic", "export")
TRACE_DEVICES = ("cpu", "cuda", "meta")
DYNAMIC_CHOICES = ("model", "auto", "none")
DEFAULT_TRACE_CACHE_GIB = 2.0  # the trace cache's size budget (Note [the trace cache's budget])


def default_cache_dir() -> Path:
    """``$FXPIPE_CACHE_DIR``, else ``$XDG_CACHE_HOME/fxpipe``, else ``~/.cache/fxpipe``; traces
    go in its ``traces`` folder (Note [the trace cache] in ``fxpipe.tracer.trace_cache``)."""
    if os.environ.get("FXPIPE_CACHE_DIR"):
        return Path(os.environ["FXPIPE_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "fxpipe"


def _check_cache_gib(gib: float) -> str | None:
    if isinstance(gib, bool) or not isinstance(gib, (int, float)) or not 0 < gib < math.inf:
        return f"--trace-cache-gib {gib!r} is not a positive number of GiB; use e.g. --trace-cache-gib 2"
    return None


@dataclass(frozen=True, kw_only=True)
class ModelTraceOptions(Options):
    """Which functions of the model file build the model and its inputs (``model_fn``,
    ``inputs_fn``; ``None``: ``build_model`` and ``example_inputs``), and how to trace it:
    ``frontend``, the module types or paths kept whole (``leaves``), ``trace_device`` and the
    device whose analytic costs price the units (``cost_device``), whether to measure
    times and activation memory instead of estimating them, and whether to price the units as
    compiled stages run them (``compile``, ``compile_factor``)."""

    what: ClassVar[str] = "trace options"

    model_fn: str | None = option(
        None, metavar="NAME", none_means="build_model", help="model factory function"
    )
    inputs_fn: str | None = option(
        None, metavar="NAME", none_means="example_inputs", help="example inputs function"
    )
    frontend: str = option(
        "auto",
        choices=FRONTENDS,
        help="tracing front end: %(choices)s (auto: symbolic when it exposes the structure)",
    )
    leaves: tuple[str, ...] = option(
        (),
        flag="--leaf",
        repeat=True,
        metavar="TYPE_OR_PATH",
        help="keep this module type (class name) or module path whole; repeatable",
    )
    trace_device: str = option(
        "cpu",
        aliases=("--device",),
        choices=TRACE_DEVICES,
        help="where to trace; meta: build the model with its parameters on the meta device "
        "and profile it analytically, for models larger than this machine",
    )
    cost_device: str | None = option(
        None,
        choices=tuple(DEVICE_PRESETS),
        none_means="the trace device; cpu for meta",
        help="device whose analytic costs price the units",
    )
    dynamic: str = option(
        "model",
        choices=DYNAMIC_CHOICES,
        help="dimensions besides the batch that follow the data: model (the model file's "
        "dynamic_dims(), if any), auto (every input dimension the model does not specialise), none",
    )
    measure_times: bool = option(
        False, help="measure forward/backward per unit instead of the analytic estimate"
    )
    measure_memory: bool = option(
        False, help="measure activation memory saved for backward per unit"
    )
    compile: bool = option(
        False,
        help="price the units as compiled stages run them (fxpipe run --compile): with "
        "--measure-times each distinct unit is timed under torch.compile, else the analytic "
        "estimate is scaled by the compiled-kernel factor",
    )
    compile_factor: float | None = option(
        None,
        metavar="RATIO",
        none_means="the cost device's factor in calibration.json",
        help="with --compile and analytic times: a compiled unit's time over its eager time",
    )

    trace_cache: str | None = option(
        None,
        metavar="DIR",
        none_means="$FXPIPE_CACHE_DIR, else $XDG_CACHE_HOME/fxpipe or ~/.cache/fxpipe",
        help="folder of the trace cache: a model traced before from the same file, inputs and "
        "options is read from it instead of traced again (another --stages, --schedule, ...)",
    )
    no_trace_cache: bool = option(
        False, help="trace afresh, neither reading nor writing the trace cache"
    )
    trace_cache_gib: float = option(
        DEFAULT_TRACE_CACHE_GIB,
        metavar="GIB",
        check=_check_cache_gib,
        help="size budget of the trace cache in GiB: after a trace is stored, the least recently "
        "used traces are removed until the cache fits",
    )

    _NOT_TRACE_KWARGS: ClassVar[tuple[str, ...]] = (
        "model_fn",
        "inputs_fn",
        "trace_cache",
        "no_trace_cache",
        "trace_cache_gib",
    )

    def __post_init__(self) -> None:
        check_options(self)

    def trace_kwargs(self) -> dict[str, Any]:
        """``fxpipe.tracer.trace_model_file``'s keyword arguments (all but the model file's function
        names and where its trace is cached)."""
        return {k: v for k, v in self.to_dict().items() if k not in self._NOT_TRACE_KWARGS} | {
            "leaves": self.leaves
        }

    def cache_dir(self) -> str | None:
        """Where the trace cache lives (Note [the trace cache] in ``fxpipe.tracer.trace_cache``),
        None without one."""
        if self.no_trace_cache:
            return None
        if self.trace_cache is not None:
            return self.trace_cache
        return str(default_cache_dir())

    def cache_budget(self) -> int:
        """The trace cache's size budget in bytes (Note [the trace cache's budget] in
        ``fxpipe.tracer.trace_cache_prune``)."""
        return int(self.trace_cache_gib * 2**30)
