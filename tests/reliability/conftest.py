"""Fixtures of the reliability probes: small builds made once, and a private copy per probe to break.

A probe is one attempt to make fxpipe misbehave (a bad file, a bad value, a tampered build,
a fault in a running job, a torn checkpoint); it holds when fxpipe answers with one clear
error line (or a clean result), runs nothing it did not check, and leaves nothing behind.
Each test here is one probe; docs/reliability.md counts them.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "runtime"):  # this folder's helpers, and the one spawn helper
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

ROOT = HERE.parents[1]

from probe_builds import make_build  # noqa: E402

# Four blocks of Linear -> Scale. ``Scale`` cannot be traced into, so it is kept
# whole (a leaf) and every stage imports it from the model file; ``FXPIPE_PROBE_LOSS`` makes loss_fn misbehave in a worker
# (or print lines that look like fxpipe's reports).
LEAF_MODEL = """
import os
import torch
import torch.nn as nn
import torch.nn.functional as F


class Scale(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(width))

    def forward(self, x):
        if bool((x != x).any()):  # control flow on a value: symbolic tracing keeps Scale whole (a leaf)
            raise ValueError("NaN input")
        return x * self.gain


class Block(nn.Module):  # every unit holds a Scale, so every stage imports it whatever the split
    def __init__(self, width_in, width):
        super().__init__()
        self.linear = nn.Linear(width_in, width)
        self.scale = Scale(width)

    def forward(self, x):
        return self.scale(self.linear(x))


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(Block(8, 16), Block(16, 16), Block(16, 16), Block(16, 4))


def example_inputs(b):
    return (torch.randn(b, 8, generator=torch.Generator().manual_seed(1)),)


def example_targets(b):
    return torch.randint(0, 4, (b,), generator=torch.Generator().manual_seed(2))


def loss_fn(out, target):
    how = os.environ.get("FXPIPE_PROBE_LOSS", "")
    if how == "raise":
        raise ValueError("bad loss on purpose")
    if how == "exit":
        import sys
        sys.exit(3)
    if how == "_exit":
        os._exit(7)
    if how == "slow":
        import time
        time.sleep(0.05)
    if how == "forge":  # a user's log lines that look like fxpipe's own error and failure reports
        import sys
        print("error: [rank 0] PeerError: a line the model printed", flush=True)
        print("error: [rank 1] ModelFileError: another line the model printed", file=sys.stderr, flush=True)
        print('fxpipe-agent: {"rank": 0, "exitcode": 1, "signal": null, "time": 0}', file=sys.stderr, flush=True)
    return F.cross_entropy(out, target)
"""


@pytest.fixture(scope="session")
def leaf_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project whose every stage imports ``Scale`` from the model file."""
    folder = tmp_path_factory.mktemp("leaf") / "project"
    make_build(folder, LEAF_MODEL)
    return folder


@pytest.fixture(scope="session")
def shared_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project whose stages both hold a ``Block(16, 16)``: the class is written once, in shared.py
    (Note [classes several stages share]), and imports ``Scale`` from the model file."""
    folder = tmp_path_factory.mktemp("shared") / "project"
    make_build(
        folder,
        LEAF_MODEL.replace(
            "nn.Sequential(Block(8, 16), Block(16, 16), Block(16, 16), Block(16, 4))",
            "nn.Sequential(Block(8, 16), *(Block(16, 16) for _ in range(4)), Block(16, 4))",
        ),
    )
    return folder


@pytest.fixture
def shared_copy(shared_project: Path, tmp_path: Path) -> Path:
    shutil.copytree(
        shared_project, tmp_path / "project", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path / "project" / "build"


@pytest.fixture(scope="session")
def mlp_project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A project whose stages import nothing from the model file (examples/mlp.py)."""
    folder = tmp_path_factory.mktemp("mlp") / "project"
    make_build(folder, (ROOT / "examples" / "mlp.py").read_text())
    return folder


@pytest.fixture
def leaf_copy(leaf_project: Path, tmp_path: Path) -> Path:
    """A private copy of ``leaf_project`` (model file and build) to tamper with; returns its build."""
    shutil.copytree(
        leaf_project, tmp_path / "project", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tmp_path / "project" / "build"


@pytest.fixture
def mlp_copy(mlp_project: Path, tmp_path: Path) -> Path:
    shutil.copytree(mlp_project, tmp_path / "project", ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path / "project" / "build"
