"""User-facing errors: every failure a user can act on is an ``FxpipeError``.

The CLI prints ``error: <message>`` on one line and exits 2 for these; anything
else is a bug in fxpipe and keeps its traceback. Every error class lives here, so the
launcher can re-raise a worker's error line under its own class.
"""

from __future__ import annotations

__all__ = [
    "FxpipeError",
    "ModelFileError",
    "TraceError",
    "ProfileError",
    "PartitionError",
    "InfeasibleError",
    "PinError",
    "CodegenError",
    "EquivalenceError",
    "BuildDirError",
    "CallError",
    "RuntimeSetupError",
    "PeerError",
    "ScheduleError",
    "StepError",
    "CheckpointError",
    "ConfigError",
    "WeightsError",
    "DivergenceError",
    "BatchMismatchError",
]


class FxpipeError(Exception):
    """Base class of errors whose message tells the user what to change.

    The CLI prints the message as one line, with any character that is not printable (a
    newline in a path) escaped, unless the class sets ``multiline`` (a report laid out over
    lines on purpose, such as a schedule's grid)."""

    exit_code: int = 2
    multiline: bool = False


class ModelFileError(FxpipeError):
    """The model file is missing, does not import, or lacks a required function."""


class TraceError(FxpipeError):
    """Neither front end could trace the model."""

    multiline = True  # one line per front end, then the fix


class ProfileError(FxpipeError):
    """A profile JSON file is malformed or inconsistent."""


class PartitionError(FxpipeError):
    """The partitioning problem is ill-posed (e.g. more stages than units)."""


class InfeasibleError(PartitionError):
    """No assignment satisfies the memory limit or the pins."""


class PinError(PartitionError):
    """Manual ``fxpipe.partition(i)`` pins contradict each other or the graph order."""


class CodegenError(FxpipeError):
    """A stage could not be emitted as source."""


class EquivalenceError(CodegenError):
    """The emitted stages, chained, do not compute what the model computes (the build is refused)."""


class BuildDirError(FxpipeError):
    """A build directory is missing files, tampered with, or of an unknown schema."""


class CallError(FxpipeError, TypeError):
    """A built model was called with arguments that differ from the call it was traced with."""


class RuntimeSetupError(FxpipeError):
    """The distributed job is misconfigured (world size, backend, environment)."""


class PeerError(FxpipeError):
    """A peer rank failed or did not answer within the timeout."""


class ScheduleError(RuntimeSetupError):
    """A schedule would compute the wrong thing or deadlock."""

    multiline = True  # the action lists as a grid, the failing action marked


class StepError(FxpipeError):
    """The model or its backward was used outside a ``@step`` function, or out of order."""


class CheckpointError(FxpipeError):
    """A checkpoint is missing, unreadable, torn across ranks or holds more than plain data."""


class ConfigError(FxpipeError):
    """An ``fxpipe.init`` configuration key or value is invalid."""


class WeightsError(FxpipeError):
    """A checkpoint given with ``--weights`` is unreadable or does not fit the model (keys, shapes)."""


class DivergenceError(FxpipeError):
    """Training diverged (a NaN or infinite loss): the run stopped at that step, its record and last good
    checkpoint kept."""


class BatchMismatchError(FxpipeError):
    """The ranks of one pipeline were given different batches for one step (Note [one batch per
    pipeline] in ``fxpipe.runtime.pipeline.batch_agreement``)."""
