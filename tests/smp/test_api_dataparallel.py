"""The seed API with ``ddp: True`` on 4 ranks (2 partitions x 2 replicas) against one-process PyTorch.

One spawned job (``dpscenarios.job``) runs every scenario; each test checks one of them:
the all-reduce (DDP's own, or a hook registered with ``model.register_comm_hook``) equals
one-process training on the concatenated batch, ZeRO follows the
unsharded trajectory with less optimizer state per rank, ``backward_passes_per_step``
equals gradient accumulation, a PowerSGD checkpoint resumes exactly, the GradScaler
skips a step on all ranks for an inf on one, ``torch.autocast`` covers the stages, and
``model.join()`` finishes uneven replicas.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from dpscenarios import PARTITIONS, REPLICAS, RESUME_SPLIT, job, reference
from spawn import spawn

TIGHT = {"rtol": 1e-5, "atol": 1e-6}
WORLD = PARTITIONS * REPLICAS


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    directory = tmp_path_factory.mktemp("dp_ckpt")
    return [r.value for r in spawn(job, WORLD, str(directory), timeout=300)]


def _replica_mean(results: list[dict[str, Any]], name: str) -> torch.Tensor:
    """The step losses averaged over the replicas (every stage of a replica reports the same)."""
    return torch.tensor([results[r * PARTITIONS][name]["losses"] for r in range(REPLICAS)]).mean(0)


@pytest.mark.distributed
def test_rank_functions_and_groups(results: list[dict[str, Any]]) -> None:
    for r, res in enumerate(results):
        assert res["ranks"] == {
            "rank": r,
            "size": WORLD,
            "mp_rank": r % PARTITIONS,
            "mp_size": PARTITIONS,
            "dp_rank": r // PARTITIONS,
            "dp_size": REPLICAS,
            "group_sizes": [WORLD, 2, 2],
            "dp_peers": [r % PARTITIONS, r % PARTITIONS + PARTITIONS],
        }
        # the plan made at the first step prices this run's data parallelism (DDP's 25 MiB buckets)
        cost = res["plan_cost"]
        assert (cost["dp_replicas"], cost["comm_hook"], cost["dp_bucket_bytes"]) == (
            REPLICAS,
            "allreduce",
            25 * 2**20,
        )


@pytest.mark.distributed
def test_ddp_equals_one_process_training_on_the_concatenated_batch(
    results: list[dict[str, Any]],
) -> None:
    losses, state, opt_state = reference(3)
    torch.testing.assert_close(_replica_mean(results, "allreduce"), torch.tensor(losses), **TIGHT)
    for rank, res in enumerate(results):
        got = res["allreduce"]
        assert list(got["state"]) == list(state)
        torch.testing.assert_close(got["state"], state, **TIGHT, msg=f"rank {rank}")
        # every replica started from replica 0's weights, and the tied copy on stage 1 matches too
        for key, value in got["local"].items():
            torch.testing.assert_close(value, state[key], **TIGHT, msg=f"{key} on rank {rank}")
        assert got["optimizer"]["param_groups"] == opt_state["param_groups"]
        torch.testing.assert_close(got["optimizer"]["state"], opt_state["state"], **TIGHT)
    assert "emb.weight" in results[1]["allreduce"]["local"]  # the tie really spans the two stages


@pytest.mark.distributed
def test_registered_comm_hook_runs_and_trains_the_same(results: list[dict[str, Any]]) -> None:
    losses, state, _ = reference(3)
    torch.testing.assert_close(_replica_mean(results, "custom_hook"), torch.tensor(losses), **TIGHT)
    for res in results:
        assert res["custom_hook"]["calls"] >= 3  # at least one bucket per step
        torch.testing.assert_close(res["custom_hook"]["state"], state, **TIGHT)


@pytest.mark.distributed
def test_sharded_optimizer_state_follows_the_unsharded_trajectory(
    results: list[dict[str, Any]],
) -> None:
    for rank, res in enumerate(results):
        zero, plain = res["zero"], res["allreduce"]
        torch.testing.assert_close(zero["losses"], plain["losses"], **TIGHT)
        torch.testing.assert_close(zero["local"], plain["local"], **TIGHT, msg=f"rank {rank}")
        # DistributedOptimizer.state_dict() still gathers the full (unsharded) state
        assert zero["optimizer"]["param_groups"] == plain["optimizer"]["param_groups"]
        torch.testing.assert_close(zero["optimizer"]["state"], plain["optimizer"]["state"], **TIGHT)
    # a full state dict loaded back into either optimizer restores the momentum (a 4th step as in one process)
    state4 = reference(4)[1]
    for rank, res in enumerate(results):
        for name in ("allreduce", "zero"):
            for key, value in res[name]["reloaded"].items():
                torch.testing.assert_close(
                    value, state4[key], **TIGHT, msg=f"{name} reloaded: {key} rank {rank}"
                )
    for stage in range(PARTITIONS):
        ranks = [r * PARTITIONS + stage for r in range(REPLICAS)]
        unsharded = results[ranks[0]]["allreduce"]["state_bytes"]
        shards = [results[r]["zero"]["state_bytes"] for r in ranks]
        assert sum(shards) == unsharded and max(shards) < unsharded, (stage, shards, unsharded)


@pytest.mark.distributed
def test_backward_passes_per_step_equals_gradient_accumulation(
    results: list[dict[str, Any]],
) -> None:
    losses, state, _ = reference(4, every=2)
    torch.testing.assert_close(_replica_mean(results, "accumulate"), torch.tensor(losses), **TIGHT)
    for res in results:
        torch.testing.assert_close(res["accumulate"]["state"], state, **TIGHT)
        assert "backward_passes_per_step=2" in res["early_step"]
    every_step = reference(4)[1]
    assert not torch.allclose(
        every_step["l1.weight"], results[0]["accumulate"]["state"]["l1.weight"], atol=1e-4
    )


@pytest.mark.distributed
def test_powersgd_checkpoint_resumes_the_uninterrupted_trajectory(
    results: list[dict[str, Any]],
) -> None:
    for rank, res in enumerate(results):
        got = res["resume"]
        assert got["hook_iter"] == RESUME_SPLIT
        torch.testing.assert_close(
            got["resumed"], got["uninterrupted"], rtol=0, atol=0, msg=f"rank {rank}"
        )
    # without the error-feedback state the resumed run drifts: the check above can tell
    assert any(
        not torch.equal(res["resume"]["without_hook"][k], v)
        for res in results
        for k, v in res["resume"]["uninterrupted"].items()
    )


@pytest.mark.distributed
def test_grad_scaler_skips_the_step_on_every_rank(results: list[dict[str, Any]]) -> None:
    for res in results:  # the inf was written on global rank 3 only
        assert [r["stepped"] for r in res["scaler"]] == [True, False, True]
        assert [r["scale"] for r in res["scaler"]] == [1024.0, 512.0, 512.0]


@pytest.mark.distributed
def test_user_autocast_runs_the_stages_in_bfloat16(results: list[dict[str, Any]]) -> None:
    losses, state, _ = reference(3, autocast=True)
    fp32_losses, _, _ = reference(3)
    got = _replica_mean(results, "autocast")
    torch.testing.assert_close(got, torch.tensor(losses), atol=2e-2, rtol=0)
    assert not torch.equal(got, torch.tensor(fp32_losses))  # it really ran in reduced precision
    assert got[-1] < got[0]  # and trains
    for res in results:
        assert res["autocast"]["dtypes"] == ["torch.bfloat16"]
        torch.testing.assert_close(res["autocast"]["state"], state, atol=2e-2, rtol=0)


@pytest.mark.distributed
def test_join_finishes_uneven_replicas_with_equal_weights(results: list[dict[str, Any]]) -> None:
    for stage in range(PARTITIONS):
        a, b = results[stage]["join"], results[PARTITIONS + stage]["join"]
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=f"stage {stage}")
