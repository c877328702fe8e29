"""Sharded data parallelism on 4 ranks (2 stages x 2 replicas) against one-process training.

One spawned job runs every sharding level one after another with Adam: each must equal
one process training the whole model on the replicas' concatenated batches (fp32,
rtol 1e-5), keep 1/R of the parameters, gradients and optimizer state per rank as the
level says, hand the collectives the bytes the cost model prices (within 10%), and
resume from a sharded or a full checkpoint onto the uninterrupted trajectory, bit for bit;
and, on a model whose parameters dominate (``heavy_params``, SGD), ``full`` must peak well
below ``none``, as on ``examples/gpt.py`` (``gpt_peaks``: activations half the peak, a block
45% of its stage).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import blocks
import gpt_peaks
import heavy_params
from concat_reference import train_on_concatenated_batches
from fxpipe.partitioner.cost import CostModel
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import CollectiveCounter, DataParallelOptions
from fxpipe.runtime.dataparallel.state_dict import (
    full_state_dicts,
    load_stage_checkpoint,
    save_stage_checkpoint,
)
from spawn import spawn

STAGES, REPLICAS, BATCH, LR, STEPS = 2, 2, 4, 0.02, 3

# name: (options, schedule, microbatches)
LEVELS = {
    "none": (DataParallelOptions(), "1f1b", 2),
    "optimizer": (DataParallelOptions(shard="optimizer"), "1f1b", 2),
    "grad-op": (DataParallelOptions(shard="grad-op"), "1f1b", 2),
    "full": (DataParallelOptions(shard="full"), "1f1b", 2),
    "full_gpipe_microbatch": (
        DataParallelOptions(shard="full", shard_reduce="microbatch"),
        "gpipe",
        2,
    ),
    "grad-op_stage_unit": (DataParallelOptions(shard="grad-op", shard_wrap="stage"), "gpipe", 1),
    "full_min_params": (
        DataParallelOptions(shard="full", shard_wrap="params", shard_min_params=250),
        "1f1b",
        2,
    ),  # the fc layers
}
MIXED = DataParallelOptions(
    shard="full", shard_param_dtype="bfloat16", shard_reduce_dtype="float32"
)
RESUME = {
    "full": True,
    "grad-op": False,
    "optimizer": True,
}  # level: sharded checkpoint (else full)


def _batch(step: int, replica: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return blocks.batch(BATCH, seed=1000 * step + replica)


def _runner(
    options: DataParallelOptions, schedule: str = "1f1b", microbatches: int = 2
) -> PipelineRunner:
    return PipelineRunner(
        blocks.manifest(),
        blocks.loss_fn,
        stage_loader=blocks.stage_loader(),
        schedule=schedule,
        microbatches=microbatches,
        optimizer_factory=lambda p: torch.optim.Adam(p, lr=LR),
        timeout_s=120,
        data_parallel=options,
    )


def _train(runner: PipelineRunner, steps: range) -> list[float]:
    return [runner.step(*_batch(k, runner.replica)) for k in steps]


def _local_bytes(tensors: Any) -> int:
    return sum(
        (t.to_local() if isinstance(t, DTensor) else t).nbytes
        for t in tensors
        if isinstance(t, torch.Tensor)
    )


def _measure(runner: PipelineRunner) -> dict[str, Any]:
    """Per rank: bytes of parameters, gradients and optimizer state it holds; one step's collectives."""
    stage = runner.stage
    opt = runner.optimizer.optim if hasattr(runner.optimizer, "optim") else runner.optimizer
    out = {
        "param_bytes": _local_bytes(stage.parameters()),
        "grad_bytes": _local_bytes(p.grad for p in stage.parameters()),
        "state_bytes": _local_bytes(v for s in opt.state.values() for v in s.values()),
    }
    with CollectiveCounter(runner.groups.data_parallel) as counter:
        runner.step(*_batch(STEPS, runner.replica))
    out["calls"], out["wire_bytes"] = dict(counter.calls), counter.wire_bytes
    return out


def _resume(level: str, sharded: bool, tmp: Path) -> dict[str, Any]:
    options, schedule, m = LEVELS[level]
    runner = _runner(options, schedule, m)
    _train(runner, range(4))
    want = full_state_dicts(runner.stage, runner.optimizer, runner.groups.data_parallel)
    runner = _runner(options, schedule, m)
    _train(runner, range(2))
    save_stage_checkpoint(
        tmp / level,
        runner.stage_index,
        runner.stage,
        runner.optimizer,
        runner.groups.data_parallel,
        sharded=sharded,
    )
    resumed = _runner(options, schedule, m)
    load_stage_checkpoint(
        tmp / level,
        resumed.stage_index,
        resumed.stage,
        resumed.optimizer,
        resumed.groups.data_parallel,
    )
    _train(resumed, range(2, 4))
    got = full_state_dicts(resumed.stage, resumed.optimizer, resumed.groups.data_parallel)
    return {"want": want, "got": got, "files": sorted(p.name for p in (tmp / level).iterdir())}


def _job(rank: int, world: int, tmp: Path, gpt_build: Path) -> dict[str, Any]:
    dist.init_process_group("gloo")
    out: dict[str, Any] = {}
    for name, (options, schedule, m) in LEVELS.items():
        runner = _runner(options, schedule, m)
        losses = _train(runner, range(STEPS))
        model, _ = full_state_dicts(runner.stage, runner.optimizer, runner.groups.data_parallel)
        out[name] = {"losses": losses, "state": model, **_measure(runner)}
    runner = _runner(MIXED)
    out["mixed"] = {
        "losses": _train(runner, range(STEPS)),
        "state": full_state_dicts(runner.stage, None, runner.groups.data_parallel)[0],
        **_measure(runner),
    }
    out["resume"] = {level: _resume(level, sharded, tmp) for level, sharded in RESUME.items()}
    out["peaks"] = heavy_params.measure_peaks(
        rank, {"none": DataParallelOptions(), "full": DataParallelOptions(shard="full")}
    )
    out["gpt_peaks"] = gpt_peaks.measure_peaks(
        gpt_build, {"none": DataParallelOptions(), "full": DataParallelOptions(shard="full")}
    )
    dist.destroy_process_group()
    return out


def reference(steps: int, microbatches: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, Adam, the replicas' batches concatenated: the mean loss over R x M microbatches."""
    return train_on_concatenated_batches(
        blocks.build_reference(),
        _batch,
        steps,
        REPLICAS,
        microbatches,
        blocks.loss_fn,
        lambda p: torch.optim.Adam(p, lr=LR),
    )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("sharded")
    gpt_build = gpt_peaks.build(tmp / "gpt")
    return [r.value for r in spawn(_job, STAGES * REPLICAS, tmp, gpt_build, timeout=600)]


def _replica_mean(results: list[dict], name: str) -> torch.Tensor:
    return torch.stack(
        [torch.tensor(results[r * STAGES][name]["losses"]) for r in range(REPLICAS)]
    ).mean(0)


@pytest.mark.distributed
@pytest.mark.slow
def test_every_level_equals_one_process_adam_on_the_concatenated_batch(results: list[dict]) -> None:
    for name, (_, _, m) in LEVELS.items():
        want_losses, want_state = reference(STEPS, m)
        torch.testing.assert_close(
            _replica_mean(results, name), torch.tensor(want_losses), rtol=1e-5, atol=1e-6, msg=name
        )
        for rank, res in enumerate(results):
            for key, value in res[name]["state"].items():
                torch.testing.assert_close(
                    value, want_state[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key} {rank}"
                )
    # the tied copies agree, and the unused parameter never moved
    assert torch.equal(
        results[0]["full"]["state"]["emb.weight"], results[1]["full"]["state"]["emb.weight"]
    )
    torch.testing.assert_close(results[1]["full"]["state"]["unused"], torch.ones(3))


@pytest.mark.distributed
@pytest.mark.slow
def test_bf16_parameters_with_fp32_reduction_train_close_and_gather_half_the_bytes(
    results: list[dict],
) -> None:
    want_losses, want_state = reference(STEPS, 2)
    torch.testing.assert_close(
        _replica_mean(results, "mixed"), torch.tensor(want_losses), rtol=1e-2, atol=0
    )
    for key, value in results[0]["mixed"]["state"].items():
        assert value.dtype == torch.float32  # the sharded master weights stay fp32
        torch.testing.assert_close(value, want_state[key], rtol=0, atol=5e-2)
    assert not torch.equal(
        results[0]["mixed"]["state"]["blocks.0.fc.weight"], want_state["blocks.0.fc.weight"]
    )
    fp32, bf16 = results[0]["full"]["wire_bytes"], results[0]["mixed"]["wire_bytes"]
    assert bf16 < 0.8 * fp32  # all-gathers in bf16, reduce-scatters in fp32


@pytest.mark.distributed
@pytest.mark.slow
def test_each_rank_keeps_its_share_of_the_training_state(results: list[dict]) -> None:
    for stage in range(STAGES):
        ranks = [r * STAGES + stage for r in range(REPLICAS)]
        none = results[ranks[0]]["none"]
        for level, sharded in (
            ("optimizer", ("state_bytes",)),
            ("grad-op", ("param_bytes", "grad_bytes", "state_bytes")),
            ("full", ("param_bytes", "grad_bytes", "state_bytes")),
        ):
            for kind in ("param_bytes", "grad_bytes", "state_bytes"):
                shares = [results[r][level][kind] for r in ranks]
                if (
                    kind in sharded
                ):  # 1/R each; FSDP pads dim 0 to a multiple of R, and (unlike DDP's
                    # synchronising pass) gives the unused parameter no gradient
                    assert all(s < 0.7 * none[kind] for s in shares), (
                        stage,
                        level,
                        kind,
                        shares,
                        none[kind],
                    )
                    assert 0.99 * none[kind] <= sum(shares) <= 1.1 * none[kind], (
                        stage,
                        level,
                        kind,
                        shares,
                    )
                else:
                    assert shares == [none[kind]] * REPLICAS, (stage, level, kind)


@pytest.mark.distributed
@pytest.mark.slow
def test_collectives_per_step_are_what_the_cost_model_prices(results: list[dict]) -> None:
    expected_calls = {
        "none": {"all_reduce": 1},
        "optimizer": {"all_reduce": 1},
        "grad-op": {"all_gather": 3, "reduce_scatter": 3},  # 3 units, gathered once
        # full: each block (37% of its stage) split into its norm and fc, stage 0's embedding a
        # unit of its own (Note [units small enough to save]): 5 units with gradients, gathered
        # per F and B of 2 microbatches
        "full": {"all_gather": 20, "reduce_scatter": 5},
        "full_gpipe_microbatch": {"all_gather": 20, "reduce_scatter": 10},
        "grad-op_stage_unit": {"all_gather": 1, "reduce_scatter": 1},
    }
    for name, (options, _, m) in [*LEVELS.items(), ("mixed", (MIXED, "1f1b", 2))]:
        for rank, res in enumerate(results):
            stage = rank % STAGES
            if name in expected_calls:
                calls = {k: v for k, v in res[name]["calls"].items() if k != "broadcast"}
                assert calls == expected_calls[name], (name, rank, res[name]["calls"])
            shapes = (
                [tuple(p.shape) for p in blocks.Stage0(blocks.build_reference()).parameters()]
                if stage == 0
                else [tuple(p.shape) for p in blocks.Stage1(blocks.build_reference()).parameters()]
            )
            nbytes = [4 * int(torch.tensor(s).prod()) for s in shapes]
            cost = CostModel(**options.cost_fields(REPLICAS))
            predicted = cost.shard_traffic(nbytes, shapes, m).wire_bytes(REPLICAS)
            assert abs(res[name]["wire_bytes"] - predicted) <= 0.1 * predicted, (
                name,
                rank,
                res[name],
                predicted,
            )


@pytest.mark.distributed
@pytest.mark.slow
def test_resume_from_a_checkpoint_follows_the_uninterrupted_trajectory(results: list[dict]) -> None:
    for rank, res in enumerate(results):
        for level, sharded in RESUME.items():
            got = res["resume"][level]
            stage = rank % STAGES
            assert f"stage_{stage}" + ("" if sharded else ".pt") in got["files"], got["files"]
            for key, value in got["want"][0].items():
                torch.testing.assert_close(
                    got["got"][0][key], value, rtol=0, atol=0, msg=f"{level} {key} {rank}"
                )
            if got["want"][1]:  # ZeRO's full optimizer state lives on the group's first rank
                assert set(got["got"][1]["state"]) == set(got["want"][1]["state"])
                if (
                    level != "optimizer"
                ):  # FSDP gives the unused parameter no gradient, so it never gets state
                    assert "unused" not in got["got"][1]["state"]
                torch.testing.assert_close(
                    got["got"][1]["state"], got["want"][1]["state"], rtol=0, atol=0
                )


@pytest.mark.distributed
@pytest.mark.slow
def test_full_sharding_peaks_at_most_085x_the_unsharded_run_where_parameters_dominate(
    results: list[dict],
) -> None:
    # issue 35, 8c: measured 0.72x on every rank; 0.84x before FSDP's backward prefetch and deferred
    # all-gather frees were turned off on CPU (Note [gathers in a pipeline]), and 1.01-1.09x with
    # 2 units per stage
    for rank, res in enumerate(results):
        none, full = res["peaks"]["none"]["peak"], res["peaks"]["full"]["peak"]
        # parameters dominate: P + P + DDP's bucket is nearly all of the unsharded peak
        assert 3 * heavy_params.PARAM_BYTES >= 0.95 * none, (rank, none)
        # the peak moves with when the async all-gathers complete (Note [gathers in a pipeline]):
        # 0.72x run alone, 0.801x once inside a whole make test run (2026-11-28)
        assert full <= 0.85 * none, (rank, full, none, full / none)
        # the same trajectory as DDP's (one process's: the equality test above, on blocks)
        torch.testing.assert_close(
            torch.tensor(res["peaks"]["full"]["losses"]),
            torch.tensor(res["peaks"]["none"]["losses"]),
            rtol=1e-5,
            atol=0,
        )


@pytest.mark.distributed
@pytest.mark.slow
def test_full_sharding_peaks_at_most_095x_the_unsharded_run_on_gpt(results: list[dict]) -> None:
    # issue 35, 8c: examples/gpt.py, 2 blocks a stage; measured 0.942x / 0.904x (stage 0 / 1) with
    # the blocks split into the children they call and the stage's own children made units (Note
    # [units small enough to save]); 1.023x / 1.050x with one unit per block, whose gathered
    # parameters and flat all-gather buffer outweighed the half of the parameters sharding saves
    for rank, res in enumerate(results):
        peaks = res["gpt_peaks"]
        assert peaks["full"]["stage"] == [rank % STAGES]
        none, full = peaks["none"]["peak"], peaks["full"]["peak"]
        assert full <= 0.95 * none, (rank, full, none, full / none)
        torch.testing.assert_close(
            torch.tensor(peaks["full"]["losses"]),
            torch.tensor(peaks["none"]["losses"]),
            rtol=1e-5,
            atol=0,
        )
