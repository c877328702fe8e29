"""``python -m fxpipe.runtime.launch.agent <torchrun arguments>``: torchrun, as ``fxpipe run`` starts it.

This is PyTorch's own launcher (``torch.distributed.run``: its argument parser and its
``run``) with three differences that ``fxpipe run`` needs:

- it dies with the ``fxpipe run`` process that started it, and its workers die with it
  (``fxpipe.runtime.launch.lifeline``), so no rank outlives a killed launcher or agent;
- a failed worker does not print torchrun's ``ChildFailedError`` traceback and summary: the
  failures (``{"rank": R, "exitcode": C, "signal": NAME, "time": T}`` each) go to the job's
  folder (Note [reports, not output] in ``fxpipe.runtime.launch.reports``), from which the
  launcher says which rank died and how (without a launcher's folder: one line each,
  ``fxpipe-agent: {...}``, on stderr);
- a termination signal (the launcher stopping the job) ends it quietly, and a worker that
  does not stop on ``SIGTERM`` is killed after ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds
  (torchrun's own setting, which the launcher sets to a few seconds instead of 30).
"""

from __future__ import annotations

import os
import sys

if (
    __name__ == "__main__"
):  # Note [isolated workers] in fxpipe.runtime.launch.isolation: before any other import
    from fxpipe.runtime.launch.isolation import isolate_sys_path

    isolate_sys_path(None)

import gc  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
from collections.abc import Sequence  # noqa: E402

from fxpipe.runtime.launch.lifeline import PARENT_PID_ENV, expected_parent_from_env, tie_to_parent  # noqa: E402
from fxpipe.runtime.launch.reports import job_dir, write_agent_failures  # noqa: E402

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
        if name.startswith("torch.distributed.elastic") or name.startswith(
            "torch.distributed.launcher"
        ):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    gc.freeze()  # torch's objects are never garbage: the exit after a stop skips them (launch.py, Note [Ctrl-C])
    try:
        run(parse_args(list(sys.argv[1:] if argv is None else argv)))
    except ChildFailedError as exc:
        failures = [
            {
                "rank": rank,
                "exitcode": failure.exitcode,
                "signal": failure.signal_name() if failure.exitcode < 0 else None,
                "time": failure.timestamp,
            }
            for rank, failure in sorted(exc.failures.items())
        ]
        folder = job_dir()
        if folder is not None:
            write_agent_failures(folder, failures)
        else:
            for failure in failures:
                print(AGENT_PREFIX + json.dumps(failure), file=sys.stderr, flush=True)
        return 1
    except (
        SignalException
    ) as exc:  # stopped by the launcher (or a user's signal): the workers are gone
        return 128 + int(exc.sigval)
    except (
        Exception
    ) as exc:  # the rendezvous could not start (its port taken, ...): one report, no traceback
        cause = exc.__cause__ or exc.__context__
        text = f"{type(exc).__name__}: {str(exc).strip()}" + (
            f" ({type(cause).__name__}: {str(cause).strip()})" if cause is not None else ""
        )
        folder = job_dir()
        if folder is not None:
            write_agent_failures(folder, [{"agent_error": text[:500]}])
        else:
            print(AGENT_PREFIX + json.dumps({"agent_error": text}), file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
