"""Every rank of a pipeline trains on one batch, and on one config (issue 35, items 1 and 2).

One spawned job of 2 ranks (``batch_scenarios.job``): ``init`` with a config that differs between
the ranks; an MNIST-style loop whose unseeded shuffled loader drifts apart on the two ranks from
the second epoch (dropout on one stage, or the same draws made by hand); the same loop with a
seeded loader; a step called with differently shaped targets on one rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from batch_scenarios import BATCH, MICROBATCHES, extras, job, one_process
from spawn import spawn

TIGHT = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return [r.value for r in spawn(job, 2, timeout=400)]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


def _chunk_sums(targets: list[int]) -> list[int]:
    return [int(t.sum()) for t in torch.tensor(targets).chunk(MICROBATCHES)]


@pytest.mark.distributed
def test_unseeded_shuffle_with_dropout_trains_on_the_first_stages_batch(
    ranks: list[dict[str, Any]],
) -> None:
    first, second = ranks[0]["dropout"], ranks[1]["dropout"]
    # the scenario: rank 1's own loader shuffled differently from rank 0's after the first epoch
    steps_per_epoch = 64 // BATCH
    assert first["own_targets"][:steps_per_epoch] == second["own_targets"][:steps_per_epoch]
    assert first["own_targets"] != second["own_targets"]
    # the loss stage (rank 1) trained on rank 0's targets at every step, which rank 0 fed the model
    want = [_chunk_sums(t) for t in first["own_targets"]]
    for rank in ranks:
        assert rank["dropout"]["trained_target_sums"] == want
    assert first["losses"] == second["losses"]
    assert any(
        "differ from the first stage's (rank 0)" in w for w in second["warnings"]
    )  # said once, on rank 1
    assert len(second["warnings"]) == 1 and not first["warnings"]


@pytest.mark.distributed
@pytest.mark.parametrize("case, seeded", [("drift", False), ("seeded", True)])
def test_loader_drawing_from_drifting_rngs_matches_one_process(
    ranks: list[dict[str, Any]], case: str, seeded: bool
) -> None:
    want = one_process(epochs=3, seeded=seeded)
    for rank in ranks:
        torch.testing.assert_close(rank[case]["losses"], want, **TIGHT)
    if seeded:  # a seeded loader gives every rank the same rows: nothing to warn about
        assert not ranks[1][case]["warnings"]


@pytest.mark.distributed
def test_the_loss_stage_receives_the_first_stages_tensors_bit_for_bit(
    ranks: list[dict[str, Any]],
) -> None:
    want = extras(0)
    for rank in ranks:
        got = rank["mechanics"]["received"]
        for key, value in want.items():
            whole = value.dim() == 0  # no batch dim: every microbatch gets all of it
            pieces = [value, value] if whole else list(value.chunk(2))
            for piece, received in zip(pieces, got[key]):
                assert received.dtype == piece.dtype and received.shape == piece.shape, key
                assert torch.equal(_bits(received), _bits(piece)), key


@pytest.mark.distributed
def test_differently_shaped_step_arguments_stop_with_one_line(ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        error = rank["mechanics"]["mismatch"]
        assert error.startswith("StepError: ") and "\n" not in error
        assert (
            "argument target is a tensor of shape (8,), int64 on rank 0 but a tensor of shape (4,), int64 on rank 1"
            in error
        )


@pytest.mark.distributed
@pytest.mark.parametrize(
    "key, values",
    [
        ("microbatches", "rank 0: 4, rank 1: 2"),
        ("pipeline", "rank 0: 'simple', rank 1: 'interleaved'"),
    ],
)
def test_configs_differing_across_ranks_stop_at_init(
    ranks: list[dict[str, Any]], key: str, values: str
) -> None:
    for rank in ranks:
        error = rank["config"][key]
        assert error.startswith("ConfigError: ") and "\n" not in error
        assert f"'{key}'" in error and values in error
