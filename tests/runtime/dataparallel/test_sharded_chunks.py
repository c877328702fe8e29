"""FSDP per chunk: 2 ranks x 2 replicas, 2 chunks per rank, against one-process training.

``chunked.ChainLM`` in 4 stages, its embedding tied between the first and the last: under
interleaved-1f1b (loop placement) the tie crosses ranks, under zbv (V placement) both
copies sit on rank 0, where each chunk gets its own sharded copy (``chunk_ties``). Each
replica trains on its half of the batch with every chunk sharded (``grad-op``, ``full``)
and must equal one process on the whole batch: loss and every parameter, fp32, 1e-5;
zb-h1 and zbv split the backward (the reduction waits for the step's last W), dualpipev
splits one backward of one chunk. One case also resumes from a training checkpoint, and
``blocks.BlockLM`` (FSDP units nested in each stage) trains under zb-h1 at ``full``;
``examples/gpt.py``, built by the whole pipeline, under interleaved-1f1b and zbv.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

import blocks
import chunked
from builds import EXAMPLES, make_build, original_model
from concat_reference import train_on_concatenated_batches
from fxpipe.errors import ConfigError
from fxpipe.modelfile import load_model_file
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import CollectiveCounter, DataParallelOptions
from fxpipe.runtime.dataparallel.state_dict import full_state_dicts
from fxpipe.runtime.pipeline.runner import resolve_schedule
from fxpipe.runtime.train.checkpoint import restore_training_state, training_state
from reference import reference_train
from spawn import spawn

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
RANKS, REPLICAS, M, BATCH, STEPS = 2, 2, 2, 8, 3
TIGHT = {"rtol": 1e-5, "atol": 1e-6}
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.02),
}
# name: (schedule, chunks per rank, placement, shard level, optimizer)
CASES = {
    "interleaved-grad-op": ("interleaved-1f1b", 2, "loop", "grad-op", "adam"),
    "interleaved-full": ("interleaved-1f1b", 2, "loop", "full", "sgd"),
    "zbv-grad-op": ("zbv", 2, "v", "grad-op", "sgd"),
    "zbv-full": ("zbv", 2, "v", "full", "adam"),
    "zb-h1-full": ("zb-h1", 1, "loop", "full", "adam"),
    "dualpipev-grad-op": (
        "dualpipev",
        2,
        "v",
        "grad-op",
        "adam",
    ),  # splits one backward of a chunk only
}
RESUMED = "zbv-full"  # also resumed from a training checkpoint: the tied copies and Adam's state round-trip


def _batch(replica: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
    return chunked.example_batch(BATCH, seed=1 + replica)


def _runner(schedule: str, v: int, placement: str, shard: str, optimizer: str) -> PipelineRunner:
    return PipelineRunner(
        chunked.manifest(RANKS, v, placement),
        chunked.loss_fn,
        stage_loader=chunked.stage_loader(RANKS * v),
        schedule=schedule,
        microbatches=M,
        optimizer_factory=OPTIMIZERS[optimizer],
        timeout_s=60,
        data_parallel=DataParallelOptions(shard=shard),
    )


def _whole_state(runner: PipelineRunner) -> dict[str, torch.Tensor]:
    """Every chunk's parameters as whole tensors under the original model's keys (collective)."""
    state: dict[str, torch.Tensor] = {}
    for s in sorted(runner.stages):
        state.update(full_state_dicts(runner.stages[s], None, runner.groups.data_parallel)[0])
    return state


def _train(*case: Any, resume: bool = False) -> dict[str, Any]:
    runner = _runner(*case)
    inputs, target = _batch(runner.replica)
    losses = [runner.step(inputs, target) for _ in range(STEPS - 1)]
    with CollectiveCounter(runner.groups.data_parallel) as counter:
        losses.append(runner.step(inputs, target))
    sharded = all(isinstance(runner.stages[s], FSDPModule) for s in runner.stages)
    local = all(isinstance(p, DTensor) for p in runner.stage.parameters())
    ran_w = any(t.action.kind.value == "W" for t in runner.executor.last_step)
    out = {
        "losses": losses,
        "state": _whole_state(runner),
        "sharded": sharded and local,
        "ran_w": ran_w,
        "chunks": len(runner.stages),
        "calls": dict(counter.calls),
    }
    if resume:  # STEPS - 1 steps, a training checkpoint (in memory), a fresh runner, the last step
        first = _runner(*case)
        for _ in range(STEPS - 1):
            first.step(inputs, target)
        saved = training_state(first, STEPS - 1, 0, {})
        resumed = _runner(*case)
        restore_training_state(resumed, saved)
        resumed.step(inputs, target)
        out["resumed"] = _whole_state(resumed)
    return out


def _blocks_zb_h1(shard: str) -> dict[str, Any]:
    """``blocks.BlockLM`` under zb-h1: FSDP units nested in the stage, reduced by hand."""
    runner = PipelineRunner(
        blocks.manifest(),
        blocks.loss_fn,
        stage_loader=blocks.stage_loader(),
        schedule="zb-h1",
        microbatches=M,
        optimizer_factory=OPTIMIZERS["adam"],
        timeout_s=60,
        data_parallel=DataParallelOptions(shard=shard),
    )
    losses = [runner.step(*_block_batch(k, runner.replica)) for k in range(STEPS)]
    return {
        "losses": losses,
        "state": _whole_state(runner),
        "units": len(runner.data_parallel.units),
    }


def _job(rank: int, world: int, cases: dict[str, tuple]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    out = {name: _train(*case, resume=name == RESUMED) for name, case in cases.items()}
    out["blocks"] = _blocks_zb_h1("full")
    dist.destroy_process_group()
    return out


def _block_batch(step: int, replica: int) -> tuple[tuple[torch.Tensor], torch.Tensor]:
    return blocks.batch(4, seed=1000 * step + replica)


def _reference(v: int, optimizer: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, both replicas' batches concatenated, cut into R x M microbatches whose
    gradients are averaged."""
    model: nn.Module = chunked.build_reference(RANKS * v).train()
    opt = OPTIMIZERS[optimizer](model.parameters())
    parts = [_batch(r) for r in range(REPLICAS)]
    inputs = tuple(torch.cat([p[0][i] for p in parts]) for i in range(2))
    target = torch.cat([p[1] for p in parts])
    chunks = REPLICAS * M
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for mb, tgt in zip(zip(*(x.chunk(chunks) for x in inputs)), target.chunk(chunks)):
            loss = chunked.loss_fn(model(*mb), tgt)
            (loss / chunks).backward()
            total += loss.item()
        opt.step()
        losses.append(total / chunks)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def check_against_one_process(results: list[dict], cases: dict[str, tuple]) -> None:
    for name, (schedule, v, _, shard, optimizer) in cases.items():
        want_losses, want_state = _reference(v, optimizer)
        mean = torch.tensor(
            [
                sum(results[r * RANKS][name]["losses"][k] for r in range(REPLICAS)) / REPLICAS
                for k in range(STEPS)
            ]
        )
        torch.testing.assert_close(mean, torch.tensor(want_losses), **TIGHT, msg=f"{name}: losses")
        seen: set[str] = set()
        for rank, res in enumerate(results):
            got = res[name]
            assert got["sharded"], f"{name}: rank {rank} does not hold every chunk as FSDP shards"
            if schedule in ("zbv", "zb-h1") or (schedule == "dualpipev" and rank % RANKS == 0):
                assert got["ran_w"], f"{name}: no W ran on rank {rank}"
            # one reduce-scatter per chunk per step, split or not; grad-op gathers each chunk once
            assert got["calls"]["reduce_scatter"] == got["chunks"], (name, rank, got["calls"])
            if shard == "grad-op":
                assert got["calls"]["all_gather"] == got["chunks"], (name, rank, got["calls"])
            for key, value in got["state"].items():  # both tied copies of emb.weight included
                torch.testing.assert_close(
                    value, want_state[key], **TIGHT, msg=f"{name}: {key} on rank {rank}"
                )
                if name == RESUMED:
                    torch.testing.assert_close(
                        got["resumed"][key],
                        value,
                        rtol=0,
                        atol=0,
                        msg=f"{name} resumed: {key} on rank {rank}",
                    )
            seen |= set(got["state"])
        assert seen == set(want_state), f"{name}: the ranks do not hold the whole model"


@pytest.mark.distributed
@pytest.mark.slow
def test_each_chunk_sharded_trains_like_one_process_on_the_whole_batch() -> None:
    results = [r.value for r in spawn(_job, RANKS * REPLICAS, CASES, timeout=300)]
    check_against_one_process(results, CASES)
    want_losses, want_state = train_on_concatenated_batches(
        blocks.build_reference(),
        _block_batch,
        STEPS,
        REPLICAS,
        M,
        blocks.loss_fn,
        OPTIMIZERS["adam"],
    )
    mean = [
        sum(results[r * RANKS]["blocks"]["losses"][k] for r in range(REPLICAS)) / REPLICAS
        for k in range(STEPS)
    ]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(want_losses), **TIGHT)
    for rank, res in enumerate(results):
        # nested FSDP units: each block's norm and fc (a block is over a quarter of what sharding
        # saves: Note [units small enough to save]), stage 0's embedding, and the stage
        assert res["blocks"]["units"] == (6 if rank % RANKS == 0 else 5), res["blocks"]["units"]
        for key, value in res["blocks"]["state"].items():
            torch.testing.assert_close(
                value, want_state[key], **TIGHT, msg=f"blocks zb-h1: {key} on rank {rank}"
            )


def test_a_split_backward_reduces_once_per_step_not_per_microbatch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Refused on rank 0 of 2 x 2 before any process group exists."""
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": "29500",
    }.items():
        monkeypatch.setenv(key, value)
    options = DataParallelOptions(shard="full", shard_reduce="microbatch")
    build = chunked.manifest(RANKS, 2, "v")
    with pytest.raises(
        ConfigError,
        match=r"shard_reduce='microbatch' cannot follow schedule 'zbv'.*use "
        r"shard_reduce='step'",
    ):
        PipelineRunner(
            build,
            chunked.loss_fn,
            stage_loader=chunked.stage_loader(4),
            schedule="zbv",
            microbatches=M,
            data_parallel=options,
        )
    assert resolve_schedule("zbv", build, M).split_backward()


# examples/gpt.py built by tracer -> partitioner -> codegen into 2 x 2 stages, its embedding tied to
# the output head (loop placement: across ranks; V: both on rank 0), its blocks FSDP units
GPT_CASES = {"interleaved-1f1b": "grad-op", "zbv": "full"}
GPT_BATCH, GPT_M, GPT_LR = 8, 4, 0.1


def _gpt_job(rank: int, world: int, builds: dict[str, Path]) -> dict[str, Any]:
    dist.init_process_group("gloo")
    source = load_model_file(EXAMPLES / "gpt.py")
    out = {}
    for schedule, build_dir in builds.items():
        runner = PipelineRunner(
            build_dir,
            source.loss_fn,
            microbatches=GPT_M,
            timeout_s=60,
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=GPT_LR),
            data_parallel=DataParallelOptions(shard=GPT_CASES[schedule]),
        )
        rows = slice(runner.replica * GPT_BATCH, (runner.replica + 1) * GPT_BATCH)
        inputs = tuple(x[rows] for x in source.example_inputs(REPLICAS * GPT_BATCH))
        targets = source.example_targets(REPLICAS * GPT_BATCH)[rows]
        losses = [runner.step(inputs, targets) for _ in range(STEPS)]
        out[schedule] = {
            "name": runner.schedule.name,
            "losses": losses,
            "state": _whole_state(runner),
            "units": len(runner.data_parallel.units),
        }
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
@pytest.mark.slow
def test_gpt_chunked_builds_shard_every_chunk_and_train_like_one_process(tmp_path: Path) -> None:
    builds = {
        s: make_build("gpt", tmp_path / s, RANKS, GPT_BATCH, GPT_M, schedule=s) for s in GPT_CASES
    }
    results = [r.value for r in spawn(_gpt_job, RANKS * REPLICAS, builds, timeout=400)]
    source = load_model_file(EXAMPLES / "gpt.py")
    whole = REPLICAS * GPT_BATCH
    for schedule, build_dir in builds.items():
        model = original_model(build_dir, source, RANKS * 2)
        want_losses, want_state = reference_train(
            model,
            source.example_inputs(whole),
            source.example_targets(whole),
            source.loss_fn,
            STEPS,
            REPLICAS * GPT_M,
            GPT_LR,
        )
        mean = [
            sum(results[r * RANKS][schedule]["losses"][k] for r in range(REPLICAS)) / REPLICAS
            for k in range(STEPS)
        ]
        torch.testing.assert_close(
            torch.tensor(mean), torch.tensor(want_losses), **TIGHT, msg=schedule
        )
        seen: set[str] = set()
        for rank, res in enumerate(results):
            got = res[schedule]
            assert got["name"] == schedule and got["units"] > 2, got[
                "units"
            ]  # 2 chunks and their blocks
            for key, value in got["state"].items():
                torch.testing.assert_close(
                    value, want_state[key], **TIGHT, msg=f"{schedule}: {key} on rank {rank}"
                )
            seen |= set(got["state"])
        assert seen == set(want_state), f"{schedule}: the ranks do not hold the whole model"
