"""The ranks of a pipeline train on one batch (issue 35, item 1): the fingerprint that compares it, and
``fxpipe run``'s loop stopping a data function that yields other rows on one rank at step 3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from builds import make_build
from fxpipe.runtime.pipeline.fingerprint import fingerprint, tensor_fingerprint
from fxpipe.runtime.train.batch_check import batch_fingerprint, first_disagreement
from fxpipe.runtime.train.data_iter import Placeholders
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.train.training_options import TrainingOptions
from spawn import spawn

DATA = """
import torch

DIFFER = {differ!r}

def train_batches(batch_size, rank_info):
    g = torch.Generator().manual_seed(rank_info.replica)
    step = 0
    while True:
        step += 1
        x, y = torch.randn(batch_size, 32, generator=g), torch.randint(0, 10, (batch_size,), generator=g)
        if step == 3 and rank_info.rank == 1 and DIFFER:   # this rank's loader went its own way
            if DIFFER == "inputs":
                x = x.roll(1, 0)
            y = y.roll(1, 0)
        yield x, y
"""


def test_fingerprint_is_the_bytes() -> None:
    t = torch.randn(16, 8)
    assert tensor_fingerprint(t) == tensor_fingerprint(t.clone())
    assert tensor_fingerprint(t) != tensor_fingerprint(
        t[torch.randperm(16, generator=torch.Generator().manual_seed(1))]
    )
    assert tensor_fingerprint(t) != tensor_fingerprint(t.roll(1, 0))
    shuffled_columns = t[:, [1, 0, *range(2, 8)]]
    assert tensor_fingerprint(t)[1] != tensor_fingerprint(shuffled_columns)[1]
    nan = torch.tensor([float("nan"), 1.0])
    assert tensor_fingerprint(nan) == tensor_fingerprint(
        nan.clone()
    )  # bytes, not values: NaN equals itself
    assert tensor_fingerprint(torch.tensor(0.0)) != tensor_fingerprint(torch.tensor(-0.0))
    # every dtype and layout a batch may have, non-contiguous and unaligned views included
    for x in (
        torch.rand(3, 5) > 0.5,
        torch.randn(4, 3).half(),
        torch.randn(2, 2, dtype=torch.complex64),
        torch.randn(3, 2).t(),
        torch.zeros(2, 0),
        torch.tensor(2.5),
        torch.arange(7, dtype=torch.uint8)[1:],
        torch.randint(0, 50_000, (4, 9)),
    ):
        assert tensor_fingerprint(x) == tensor_fingerprint(x.clone().contiguous())
    assert fingerprint([t, t.roll(1, 0)]) != fingerprint([t.roll(1, 0), t])


def test_ranks_are_compared_on_the_parts_they_hold() -> None:
    x, y = (torch.randn(4, 3),), torch.arange(4)
    full = batch_fingerprint(x, y)
    inputs_only, targets_only = batch_fingerprint(x, None), batch_fingerprint(Placeholders(x), y)
    assert first_disagreement([full, inputs_only, targets_only], [0, 1, 2]) is None
    assert (
        first_disagreement([inputs_only, targets_only], [0, 1]) is None
    )  # nothing in common: nothing compared
    other = batch_fingerprint(x, y.flip(0))
    assert first_disagreement([full, other], [4, 5]) == ("targets", 4, 5)
    assert first_disagreement([full, batch_fingerprint((x[0].double(),), y)], [0, 1]) == (
        "inputs",
        0,
        1,
    )


def _train(rank: int, world: int, build: str, options: RunOptions) -> Any:
    from fxpipe.runtime.train.loop import train

    return train(Path(build), options, Path(build) / f"run_{rank}.json")


@pytest.mark.distributed
@pytest.mark.parametrize("differ", ["targets", "inputs"])
def test_fxpipe_run_stops_a_data_function_that_yields_other_rows_on_one_rank(
    differ: str, tmp_path: Path
) -> None:
    build = make_build("mlp", tmp_path / "build", stages=2, batch_size=8, microbatches=2)
    data = tmp_path / "data.py"
    data.write_text(DATA.format(differ=differ))
    options = RunOptions(
        steps=5,
        lr=0.1,
        timeout_s=60,
        training=TrainingOptions(data=f"{data}:train_batches", log_every=1),
    )
    results = spawn(_train, 2, str(build), options, timeout=240, expect_failure=True)
    tensor = "inputs[0]" if differ == "inputs" else "targets"
    for r in results:
        assert not r.ok
        line = r.error.splitlines()[0]
        assert line == (
            f"ModelFileError: train_batches(8, rank_info) yielded other {differ} on rank 1 than on "
            f"rank 0 at step 3 ({tensor} differs), but the ranks of one pipeline train on one batch "
            "(each reads its part of it); yield the same batches on every rank of replica 0: seed "
            "the data from rank_info.replica (0), not from the rank, the process or the global "
            "random state (e.g. torch.Generator().manual_seed(seed + rank_info.replica) for a "
            "DataLoader's generator)"
        ), line


@pytest.mark.distributed
def test_fxpipe_run_trains_on_the_same_data_on_every_rank(tmp_path: Path) -> None:
    build = make_build("mlp", tmp_path / "build", stages=2, batch_size=8, microbatches=2)
    data = tmp_path / "data.py"
    data.write_text(DATA.format(differ=""))
    options = RunOptions(
        steps=5,
        lr=0.1,
        timeout_s=60,
        training=TrainingOptions(data=f"{data}:train_batches", log_every=1),
    )
    results = spawn(_train, 2, str(build), options, timeout=240)
    assert all(r.ok for r in results)
    assert [len(r.value.losses) for r in results] == [5, 5]


def _runner(rank: int, world: int, build: str, differ_at: int, check: bool) -> Any:
    """PipelineRunner used directly: every rank draws (x, y) from one seeded generator, rank 1
    rolls its targets at step ``differ_at``; the step times with the check, for the record."""
    import time

    import torch.nn.functional as F

    from fxpipe.runtime.pipeline.runner import PipelineRunner

    g = torch.Generator().manual_seed(0)
    seconds = []
    with PipelineRunner(
        build, F.cross_entropy, microbatches=2, timeout_s=60, check_batches=check
    ) as runner:
        for step in range(1, 7):
            x, y = torch.randn(8, 32, generator=g), torch.randint(0, 10, (8,), generator=g)
            if step == differ_at and rank == 1:
                y = y.roll(1, 0)
            start = time.perf_counter()
            runner.step(x, y)
            seconds.append(time.perf_counter() - start)
    return seconds


@pytest.mark.distributed
def test_pipeline_runner_stops_ranks_given_different_targets(tmp_path: Path) -> None:
    build = make_build("mlp", tmp_path / "build", stages=2, batch_size=8, microbatches=2)
    results = spawn(_runner, 2, str(build), 3, True, timeout=240, expect_failure=True)
    for r in results:
        assert not r.ok
        line = r.error.splitlines()[0]
        assert line == (
            "BatchMismatchError: the ranks of pipeline replica 0 were given different batches at "
            "step 3: targets differs between rank 0 and rank 1, but every rank of a pipeline must "
            "be given the same batch (each reads its part of it); seed the loader alike on these "
            "ranks, e.g. DataLoader(..., generator=torch.Generator().manual_seed(seed + 0)) with "
            "the replica's index, not the rank's (or pass check_batches=False to PipelineRunner to "
            "skip this check)"
        ), line
    # the same batches on both ranks train; check_batches=False is the opt-out
    assert all(r.ok for r in spawn(_runner, 2, str(build), 0, True, timeout=240))
    assert all(r.ok for r in spawn(_runner, 2, str(build), 3, False, timeout=240))
