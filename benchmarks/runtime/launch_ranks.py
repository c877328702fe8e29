"""The command that starts a benchmark's ranks on this machine: ``torch.distributed.run`` (torchrun)
with a c10d rendezvous on a free local port, running the benchmark's own file as ``--worker``."""

from __future__ import annotations

import sys

from fxpipe.runtime.launch.launcher import free_port


def torchrun(script: str, ranks: int, *args: str, python: str = sys.executable) -> list[str]:
    """``python -m torch.distributed.run`` of ``script --worker *args`` on ``ranks`` local ranks."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(ranks),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        script,
        "--worker",
        *args,
    ]
