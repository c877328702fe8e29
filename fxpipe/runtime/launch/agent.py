"""``python -m fxpipe.runtime.launch.agent <torchrun arguments>``: torchrun, as ``fxpipe run`` starts it.

This is PyTorch's own launcher (``torch.distributed.run``: its argument parser and its
``run``) with three differences that ``fxpipe run`` needs:

- it dies with the ``fxpipe run`` process that started it, and its workers die with it
  (``fxpipe.runtime.launch.lifeline``), so no rank outlives a killed launcher or agent;
- a failed worker does not print torchrun's ``ChildFailedError`` traceback and summary:
  each failure is one line ``fxpipe-agent: {"rank": R, "exitcode": C, "signal": NAME, "time": T}``
  on stderr, which the launcher reads back to say which rank died and how;
- a termination signal (the launcher stopping the job) ends it quietly, and a worker that
  does not stop on ``SIGTERM`` is killed after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds
  (torchrun's own setting, which the launcher sets to a few seconds instead of 30).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys
from collections.abc import Sequence

from fxpipe.runtime.launch.lifeline import PARENT_PID_ENV, expected_parent_from_env, tie_to_parent

__all__ = ["main", "AGENT_PREFIX"]

AGENT_PREFIX = "fxpipe-agent: "


def main(argv: Sequence[str] | None = None) -> int:
    tie_to_parent(expected_parent_from_env())
    os.environ[PARENT_PID_ENV] = str(os.getpid())  # the workers tie themselves to this process
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # torchrun logs each failure and each shutdown before raising; the launcher reports them instead
    for name in ["torch.distributed.elastic", *logging.root.manager.loggerDict]:
        if name.startswith("torch.distributed.elastic") or name.startswith("torch.distributed.launcher"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    gc.freeze()  # torch's objects are never garbage: the exit after a stop skips them (launch.py, Note [Ctrl-C])
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as exc:
        for rank, failure in sorted(exc.failures.items()):
            signal_name = failure.signal_name() if failure.exitcode < 0 else None
            print(AGENT_PREFIX + json.dumps({"rank": rank, "exitcode": failure.exitcode, "signal": signal_name,
                                             "time": failure.timestamp}), file=sys.stderr, flush=True)
        return 1
    except SignalException as exc:  # stopped by the launcher (or a user's signal): the workers are gone
        return 128 + int(exc.sigval)
    return 0


if __name__ == "__main__":
    sys.exit(main())
