"""Hybrid data parallelism on 4 ranks (2 stages x 2 replicas) against one-process training.

One spawned job runs every configuration one after another (4 processes on 2 cores
are slow to start): plain all-reduce (several bucket layouts) must equal one-process
training on the concatenated batch; fp16/bf16 compression and PowerSGD must stay
close (bf16 is refused on gloo, as DDP does); ``backward_passes_per_step=2`` must equal gradient accumulation; ZeRO must
follow the unsharded trajectory with less optimizer state per rank; a PowerSGD
checkpoint must resume to the uninterrupted trajectory; ``join`` must finish uneven
replicas with equal weights.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import twostage
from fxpipe.errors import ConfigError
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import DataParallelOptions, optimizer_state_bytes
from spawn import spawn

STAGES, REPLICAS, BATCH, LR, MOMENTUM = 2, 2, 4, 0.5, 0.9

# name: (options, schedule, microbatches, passes, momentum)
EXACT = {
    "allreduce_gpipe": (DataParallelOptions(), "gpipe", 2, 3, False),
    "bucket_view_1f1b": (
        DataParallelOptions(gradient_as_bucket_view=True, overlapping_allreduce=False),
        "1f1b",
        2,
        3,
        False,
    ),
    "small_buckets": (DataParallelOptions(bucket_cap_mb=1e-4), "1f1b", 1, 3, False),
    "accumulate": (DataParallelOptions(backward_passes_per_step=2), "gpipe", 2, 4, False),
    "momentum": (DataParallelOptions(), "1f1b", 2, 3, True),
    "zero": (DataParallelOptions(shard_optimizer_state=True), "1f1b", 2, 3, True),
}
CLOSE = {  # name: (options, passes, tolerance on the losses, on the parameters); deviations: docs/dataparallel.md
    "fp16": (DataParallelOptions(comm_hook="fp16"), 4, 1e-3, 2e-3),
    "powersgd_r1": (DataParallelOptions(comm_hook="powersgd", powersgd_rank=1), 4, 2e-2, 0.15),
    "powersgd_r2": (DataParallelOptions(comm_hook="powersgd", powersgd_rank=2), 4, 2e-3, 3e-2),
}
RESUME = DataParallelOptions(comm_hook="powersgd", powersgd_start_iter=2)
RESUME_SPLIT, RESUME_STEPS = 3, 6


def _batch(pass_index: int, replica: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return twostage.batch(BATCH, seed=1000 * pass_index + replica)


def _optimizer(momentum: bool):
    return lambda p: torch.optim.SGD(p, lr=LR, momentum=MOMENTUM if momentum else 0.0)


def _runner(
    options: DataParallelOptions,
    schedule: str = "1f1b",
    microbatches: int = 2,
    momentum: bool = False,
) -> PipelineRunner:
    return PipelineRunner(
        twostage.manifest(),
        twostage.loss_fn,
        stage_loader=twostage.stage_loader(),
        schedule=schedule,
        microbatches=microbatches,
        optimizer_factory=_optimizer(momentum),
        timeout_s=120,
        data_parallel=options,
    )


def _train(runner: PipelineRunner, passes: range) -> list[float]:
    return [runner.step(*_batch(k, runner.replica)) for k in passes]


def _state(runner: PipelineRunner) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in runner.stage.state_dict().items()}


def _resume_job(rank: int, tmp: Path) -> dict[str, Any]:
    """PowerSGD: train, checkpoint (weights, momentum, hook state), rebuild, resume; and the same without the hook state."""
    out: dict[str, Any] = {}
    runner = _runner(RESUME, momentum=True)
    _train(runner, range(RESUME_STEPS))
    out["uninterrupted"] = _state(runner)
    runner = _runner(RESUME, momentum=True)
    _train(runner, range(RESUME_SPLIT))
    path = tmp / f"ckpt_{rank}.pt"
    torch.save(
        {
            "stage": runner.stage.state_dict(),
            "optimizer": runner.optimizer.state_dict(),
            "comm_hook": runner.data_parallel.hook_state_dict(),
        },
        path,
    )
    out["hook_iter"] = runner.data_parallel.hook_state.iter
    for restore_hook in (True, False):
        ckpt = torch.load(path, weights_only=True)
        resumed = _runner(RESUME, momentum=True)
        resumed.stage.load_state_dict(ckpt["stage"])
        resumed.optimizer.load_state_dict(ckpt["optimizer"])
        if restore_hook:
            resumed.data_parallel.load_hook_state_dict(ckpt["comm_hook"])
            out["restored_group"] = (
                resumed.data_parallel.hook_state.process_group is resumed.groups.data_parallel
            )
        _train(resumed, range(RESUME_SPLIT, RESUME_STEPS))
        out["resumed" if restore_hook else "resumed_without_hook_state"] = _state(resumed)
    return out


def _join_job() -> dict[str, torch.Tensor]:
    """Replica 0 trains 3 steps, replica 1 only 2: DDP's join shadows the missing all-reduce."""
    runner = _runner(DataParallelOptions(shard_optimizer_state=True), momentum=True)
    with runner.data_parallel.join(runner.optimizer):
        _train(runner, range(3 if runner.replica == 0 else 2))
    return _state(runner)


def _job(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, (options, schedule, m, passes, momentum) in EXACT.items():
        runner = _runner(options, schedule, m, momentum)
        out[name] = (_train(runner, range(passes)), _state(runner))
        if name == "momentum":
            out["state_bytes_unsharded"] = optimizer_state_bytes(runner.optimizer)
            out["unsharded_state"] = runner.optimizer.state_dict()
        if name == "zero":
            out["state_bytes_sharded"] = optimizer_state_bytes(runner.optimizer)
            runner.optimizer.consolidate_state_dict(to=0)  # rank 0 of the data-parallel group
            if runner.replica == 0:
                out["zero_full_state"] = runner.optimizer.state_dict()
    for name, (options, passes, _, _) in CLOSE.items():
        runner = _runner(options)
        out[name] = (_train(runner, range(passes)), _state(runner))
    try:
        _runner(DataParallelOptions(comm_hook="bf16"))
    except ConfigError as exc:  # gloo: DDP admits bf16 compression only with NCCL
        out["bf16"] = str(exc)
    out["resume"] = _resume_job(rank, tmp)
    out["join"] = _join_job()
    dist.destroy_process_group()
    return out


def reference(
    passes: int, microbatches: int, momentum: bool, passes_per_step: int = 1
) -> tuple[list[float], dict[str, torch.Tensor], torch.optim.Optimizer]:
    """One process, the replicas' batches concatenated: the same mean loss over R x M microbatches."""
    model = copy.deepcopy(twostage.build_reference()).train()
    opt = _optimizer(momentum)(list(model.parameters()))
    losses = []
    chunks = REPLICAS * microbatches
    for k in range(passes):
        if k % passes_per_step == 0:
            opt.zero_grad()
        batches = [_batch(k, r) for r in range(REPLICAS)]
        idx = torch.cat([b[0][0] for b in batches])
        target = torch.cat([b[1] for b in batches])
        total = 0.0
        for x, y in zip(idx.chunk(chunks), target.chunk(chunks)):
            loss = twostage.loss_fn(model(x), y)
            (loss / chunks).backward()
            total += loss.item()
        losses.append(total / chunks)
        if (k + 1) % passes_per_step == 0:
            opt.step()
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, opt


def _replica_mean(results: list[dict], name: str) -> torch.Tensor:
    per_replica = [torch.tensor(results[r * STAGES][name][0]) for r in range(REPLICAS)]
    return torch.stack(per_replica).mean(0)


def _check_states(
    results: list[dict], name: str, want: dict[str, torch.Tensor], **tol: float
) -> None:
    for rank, res in enumerate(results):
        for key, value in res[name][1].items():
            torch.testing.assert_close(value, want[key], msg=f"{name}: {key} on rank {rank}", **tol)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("dp")
    return [r.value for r in spawn(_job, STAGES * REPLICAS, tmp, timeout=400)]


@pytest.mark.distributed
def test_allreduce_equals_one_process_training_on_the_concatenated_batch(
    results: list[dict],
) -> None:
    for name, (options, _, m, passes, momentum) in EXACT.items():
        want_losses, want_state, _ = reference(
            passes, m, momentum, options.backward_passes_per_step
        )
        torch.testing.assert_close(
            _replica_mean(results, name), torch.tensor(want_losses), msg=name
        )
        _check_states(results, name, want_state)
    # the tied copies agree and the unused parameter never moved
    assert torch.equal(
        results[0]["allreduce_gpipe"][1]["emb.weight"],
        results[1]["allreduce_gpipe"][1]["emb.weight"],
    )
    torch.testing.assert_close(results[1]["allreduce_gpipe"][1]["unused"], torch.ones(3))


@pytest.mark.distributed
def test_accumulation_really_differs_from_stepping_every_pass(results: list[dict]) -> None:
    every_pass = reference(4, 2, False, 1)[1]
    assert not torch.allclose(
        every_pass["l1.weight"], results[0]["accumulate"][1]["l1.weight"], atol=1e-4
    )


@pytest.mark.distributed
def test_compressing_hooks_train_close_to_allreduce(results: list[dict]) -> None:
    for name, (_, passes, loss_tol, param_tol) in CLOSE.items():
        want_losses, want_state, _ = reference(passes, 2, False)
        torch.testing.assert_close(
            _replica_mean(results, name), torch.tensor(want_losses), atol=loss_tol, rtol=0, msg=name
        )
        _check_states(results, name, want_state, atol=param_tol, rtol=0)
    assert all("comm_hook 'bf16' needs CUDA with NCCL" in res["bf16"] for res in results)
    # compression is real: the hooks do not reproduce the exact all-reduce result
    exact = reference(4, 2, False)[1]
    assert not torch.allclose(
        results[0]["powersgd_r1"][1]["l1.weight"], exact["l1.weight"], atol=1e-5
    )


@pytest.mark.distributed
def test_zero_matches_unsharded_with_less_state_per_rank(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for key, value in res["zero"][1].items():
            torch.testing.assert_close(
                value, res["momentum"][1][key], msg=f"zero vs unsharded {key} rank {rank}"
            )
    for stage in range(STAGES):
        ranks = [r * STAGES + stage for r in range(REPLICAS)]
        unsharded = results[ranks[0]]["state_bytes_unsharded"]
        shards = [results[r]["state_bytes_sharded"] for r in ranks]
        assert sum(shards) == unsharded, (stage, shards, unsharded)
        if stage == 1:  # four parameters over two replicas: both hold a real share
            assert max(shards) < unsharded
    # the consolidated (full) state dict is the unsharded optimizer's, momentum buffers included
    for stage in range(STAGES):
        full, want = results[stage]["zero_full_state"], results[stage]["unsharded_state"]
        assert sorted(full["state"]) == sorted(want["state"]) and full["state"]
        for i, s in want["state"].items():
            torch.testing.assert_close(full["state"][i]["momentum_buffer"], s["momentum_buffer"])


@pytest.mark.distributed
def test_powersgd_checkpoint_resumes_the_same_trajectory(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        got = res["resume"]
        assert got["hook_iter"] == RESUME_SPLIT and got["restored_group"]
        for key, value in got["uninterrupted"].items():
            torch.testing.assert_close(
                got["resumed"][key], value, rtol=0, atol=0, msg=f"{key} on rank {rank}"
            )
    # without the error-feedback state the resumed run drifts: the test can tell
    drift = [
        not torch.equal(res["resume"]["resumed_without_hook_state"][k], v)
        for res in results
        for k, v in res["resume"]["uninterrupted"].items()
    ]
    assert any(drift)


@pytest.mark.distributed
def test_join_finishes_uneven_replicas_with_equal_weights(results: list[dict]) -> None:
    for stage in range(STAGES):
        a, b = results[stage]["join"], results[STAGES + stage]["join"]
        for key in a:
            torch.testing.assert_close(a[key], b[key], msg=f"join: {key} of stage {stage}")
