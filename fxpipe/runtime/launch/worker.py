"""Entry point of one rank: ``torchrun --nproc-per-node N -m fxpipe.runtime.launch.worker DIR [run flags]``.

The run flags are ``fxpipe run``'s (``fxpipe.runtime.train.run_options.add_run_arguments``), or
``--options PATH`` with a ``RunOptions`` JSON file (what ``fxpipe run`` passes), or both:
flags override the file. ``fxpipe.runtime.train.loop.train`` does the work. Any failure
prints one ``error: [rank R] …`` line and exits 2: ``Kind: message`` for a user-facing
``FxpipeError``, ``internal error while <phase>: <Type>: <message> (…)`` for anything
else (a model file's ``loss_fn`` raising, a bug), with the traceback before it only when
``FXPIPE_DEBUG=1`` (``fxpipe --debug run``). The launcher (``fxpipe.runtime.launch.launcher``)
reads these lines back. The process dies with its parent, the torchrun agent
(``fxpipe.runtime.launch.lifeline``).
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from fxpipe.errors import FxpipeError
from fxpipe.runtime.launch.lifeline import PARENT_PID_ENV, expected_parent_from_env, tie_to_parent
from fxpipe.runtime.train.run_options import add_run_arguments, run_options_from_args
from fxpipe.unexpected import internal_error_line, print_safely

__all__ = ["main", "parse_args", "ERROR_PREFIX", "DEBUG_ENV"]

ERROR_PREFIX = "error: [rank "
DEBUG_ENV = "FXPIPE_DEBUG"  # "1": print the traceback of an unexpected error


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fxpipe.runtime.launch.worker",
                                description="Train one pipeline stage of a build directory (run under torchrun).")
    p.add_argument("build_dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="where rank 0 writes run.json (default: BUILD_DIR/run.json)")
    add_run_arguments(p)
    return p.parse_args(argv)


def _phase(exc: BaseException) -> str:
    """What the rank was doing when ``exc`` was raised, from the functions on its traceback."""
    names = {(Path(f.filename).name, f.name) for f in traceback.extract_tb(exc.__traceback__)}
    if any(name in ("step", "forward_backward") for file, name in names if file == "runner.py"):
        return "training"
    if ("runner.py", "__init__") in names:
        return "setting up the pipeline"
    if any(file in ("integrity.py", "load.py", "modelfile.py", "data.py", "record.py") for file, _ in names):
        return "loading the build"
    return "training"


def main(argv: Sequence[str] | None = None) -> int:
    tie_to_parent(expected_parent_from_env())
    os.environ.pop(PARENT_PID_ENV, None)  # not for this rank's own children
    args = parse_args(argv)
    rank = os.environ.get("RANK", "?")
    try:
        from fxpipe.runtime.train.loop import train

        train(args.build_dir, run_options_from_args(args), args.out)
    except FxpipeError as exc:
        if os.environ.get(DEBUG_ENV) == "1":
            traceback.print_exc()
        print_safely(f"{ERROR_PREFIX}{rank}] {type(exc).__name__}: {exc}")
        return exc.exit_code
    except KeyboardInterrupt:
        print_safely(f"{ERROR_PREFIX}{rank}] interrupted")
        return 130
    except BaseException as exc:  # a model file's code, sys.exit() in it, or a bug: one line, never a traceback
        if os.environ.get(DEBUG_ENV) == "1":
            traceback.print_exc()
        print_safely(f"{ERROR_PREFIX}{rank}] {internal_error_line(exc, _phase(exc))}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
