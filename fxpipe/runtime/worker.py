"""Entry point of one rank: ``torchrun --nproc-per-node N -m fxpipe.runtime.worker DIR [run flags]``.

The run flags are ``fxpipe run``'s (``fxpipe.runtime.options.add_run_arguments``), or
``--options PATH`` with a ``RunOptions`` JSON file (what ``fxpipe run`` passes), or both:
flags override the file. ``fxpipe.runtime.training.train`` does the work. A user-facing
failure prints one ``error: [rank R] Kind: message`` line and exits 2; the launcher
(``fxpipe.runtime.launch``) reads that line back.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from fxpipe.errors import FxpipeError
from fxpipe.runtime.options import add_run_arguments, run_options_from_args

__all__ = ["main", "parse_args", "ERROR_PREFIX"]

ERROR_PREFIX = "error: [rank "


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m fxpipe.runtime.worker",
                                description="Train one pipeline stage of a build directory (run under torchrun).")
    p.add_argument("build_dir", type=Path)
    p.add_argument("--out", type=Path, default=None, help="where rank 0 writes run.json (default: BUILD_DIR/run.json)")
    add_run_arguments(p)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from fxpipe.runtime.training import train

        train(args.build_dir, run_options_from_args(args), args.out)
    except FxpipeError as exc:
        rank = os.environ.get("RANK", "?")
        print(f"{ERROR_PREFIX}{rank}] {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
