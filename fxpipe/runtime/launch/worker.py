"""Entry point of one rank: ``torchrun --nproc-per-node N -m fxpipe.runtime.launch.worker DIR [run flags]``.

The run flags are ``fxpipe run``'s (``fxpipe.runtime.train.run_options.add_run_arguments``), or
``--options PATH`` with a ``RunOptions`` JSON file (what ``fxpipe run`` passes), or both:
flags override the file. ``fxpipe.runtime.train.loop.train`` does the work. Any failure
exits 2 and is reported as ``Kind: message`` for a user-facing ``FxpipeError``, ``internal
error while <phase>: <Type>: <message> (…)`` for anything else (a model file's ``loss_fn``
raising, a bug): into the job's folder when the launcher (``fxpipe.runtime.launch.launcher``)
gave one (Note [reports, not output] in ``fxpipe.runtime.launch.reports``), else as one
``error: [rank R] …`` line; with the traceback before it only when ``FXPIPE_DEBUG=1``
(``fxpipe --debug run``), which also prints the line. The process dies with its parent, the
torchrun agent (``fxpipe.runtime.launch.lifeline``), and imports only the build's checked
files and installed packages (Note [isolated workers] in ``fxpipe.runtime.launch.isolation``).
"""

from __future__ import annotations

import os
import sys

if (
    __name__ == "__main__"
):  # Note [isolated workers] in fxpipe.runtime.launch.isolation: before any other import
    from fxpipe.runtime.launch.isolation import isolate_sys_path

    isolate_sys_path(sys.argv[1] if len(sys.argv) > 1 else None)

import argparse  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

from fxpipe.errors import FxpipeError  # noqa: E402
from fxpipe.runtime.launch.lifeline import PARENT_PID_ENV, expected_parent_from_env, tie_to_parent  # noqa: E402
from fxpipe.runtime.launch.reports import job_dir, write_rank_error  # noqa: E402
from fxpipe.runtime.train.run_options import add_run_arguments, run_options_from_args  # noqa: E402
from fxpipe.unexpected import internal_error_line, one_line, print_safely  # noqa: E402

__all__ = ["main", "parse_args", "ERROR_PREFIX", "DEBUG_ENV"]

ERROR_PREFIX = "error: [rank "
DEBUG_ENV = "FXPIPE_DEBUG"  # "1": print the traceback of an unexpected error


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m fxpipe.runtime.launch.worker",
        description="Train one pipeline stage of a build directory (run under torchrun).",
    )
    p.add_argument("build_dir", type=Path)
    p.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where rank 0 writes run.json (default: BUILD_DIR/run.json)",
    )
    add_run_arguments(p)
    return p.parse_args(argv)


def _phase(exc: BaseException) -> str:
    """What the rank was doing when ``exc`` was raised, from the functions on its traceback."""
    names = {(Path(f.filename).name, f.name) for f in traceback.extract_tb(exc.__traceback__)}
    if any(name in ("step", "forward_backward") for file, name in names if file == "runner.py"):
        return "training"
    if ("runner.py", "__init__") in names:
        return "setting up the pipeline"
    if any(
        file in ("integrity.py", "load.py", "modelfile.py", "data.py", "record.py")
        for file, _ in names
    ):
        return "loading the build"
    return "training"


def main(argv: Sequence[str] | None = None) -> int:
    tie_to_parent(expected_parent_from_env())
    os.environ.pop(PARENT_PID_ENV, None)  # not for this rank's own children
    args = parse_args(argv)
    rank = os.environ.get("RANK", "?")
    if job_dir() is not None:  # fxpipe run warned once, in the launcher
        import warnings

        from fxpipe.codegen.integrity import TorchVersionWarning

        warnings.simplefilter("ignore", TorchVersionWarning)
    try:
        from fxpipe.runtime.train.loop import train

        train(args.build_dir, run_options_from_args(args), args.out)
    except FxpipeError as exc:
        if os.environ.get(DEBUG_ENV) == "1":
            traceback.print_exc()
        _report(rank, type(exc).__name__, str(exc))
        return exc.exit_code
    except KeyboardInterrupt:
        _report(rank, None, "interrupted")
        return 130
    except (
        BaseException
    ) as exc:  # a model file's code, sys.exit() in it, or a bug: one line, never a traceback
        if os.environ.get(DEBUG_ENV) == "1":
            traceback.print_exc()
        _report(rank, None, internal_error_line(exc, _phase(exc)))
        return 2
    return 0


def _report(rank: str, kind: str | None, message: str) -> None:
    """Tell the launcher (Note [reports, not output]); print the line when there is none to tell, or when debugging."""
    folder = job_dir()
    if folder is not None:
        write_rank_error(folder, rank, kind, message)
    if folder is None or os.environ.get(DEBUG_ENV) == "1":
        print_safely(one_line(f"{ERROR_PREFIX}{rank}] {kind + ': ' if kind else ''}{message}"))


if __name__ == "__main__":
    sys.exit(main())
