"""The seed API's ``"pipeline"`` with several stages per process (``interleaved-1f1b``, ``zbv``,
``dualpipev``): on 2 ranks it trains like one process (loss and every parameter, fp32), with a tied
embedding and a model input used by the last stage (Note [chunked schedules in the seed API] in ``fxpipe.smp.chunks``);
with ``ddp: True`` on 4 ranks (2 partitions x 2 replicas, each replica on its half of the batch) it trains
like one process on the whole batch: the replicas average their gradients once per step, after the last ``W``."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import fxpipe.smp as api
from fxpipe.errors import ConfigError
from fxpipe.smp.optimizer import sharded_optimizer
from chunked import SEQ, VOCAB, ChainLM
from spawn import spawn

BATCH, MICROBATCHES, STEPS, LR = 8, 4, 3, 0.2
SCHEDULES = (
    {"pipeline": "zbv"},
    {"pipeline": "interleaved-1f1b", "virtual_stages": 2},
    {"pipeline": "dualpipev"},
)


def _build() -> ChainLM:
    """Embedding tied to the output projection, and a float input that only the end uses."""
    torch.manual_seed(0)
    return ChainLM(6)


def _batch(step: int, rows: int = BATCH) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step % 2)  # step 2 sees step 0's batch again
    return (
        torch.randint(0, VOCAB, (rows, SEQ), generator=g),
        torch.rand(rows, SEQ, 1, generator=g),
        torch.randint(0, VOCAB, (rows, SEQ), generator=g),
    )


def _loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


@api.step
def _train_step(
    model: Any, idx: torch.Tensor, scale: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    loss = _loss(model(idx, scale), target)
    model.backward(loss)
    return loss


@api.step
def _eval_step(
    model: Any, idx: torch.Tensor, scale: torch.Tensor, target: torch.Tensor
) -> torch.Tensor:
    with torch.no_grad():
        return _loss(model(idx, scale), target)


def _job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config in SCHEDULES:
        api.init({"partitions": 2, "microbatches": MICROBATCHES, **config})
        model = api.DistributedModel(_build(), trace_device="cpu")
        opt = api.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        losses = []
        for k in range(STEPS):
            opt.zero_grad()
            losses.append(_train_step(model, *_batch(k)).reduce_mean().item())
            opt.step()
        grads_before = {
            n: p.grad.clone() for n, p in model.local_named_parameters() if p.grad is not None
        }
        evaluated = _eval_step(model, *_batch(0)).reduce_mean().item()
        untouched = all(
            torch.equal(p.grad, grads_before[n])
            for n, p in model.local_named_parameters()
            if p.grad is not None
        )
        out[config["pipeline"]] = {
            "losses": losses,
            "eval": evaluated,
            "grads_untouched": untouched,
            "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
            "stage_ranks": list(model.manifest.stage_ranks),
            "local_keys": sorted(k for k in model.local_state_dict() if k != "_smp_is_partial"),
        }
        api.shutdown(destroy_process_group=False)
    return out


def _one_process(replicas: int = 1) -> tuple[list[float], float, dict[str, torch.Tensor]]:
    """One process on the replicas' batches together, in microbatches of the pipeline's size."""
    model = copy.deepcopy(_build()).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    losses, parts = [], replicas * MICROBATCHES
    for k in range(STEPS):
        opt.zero_grad()
        idx, scale, target = _batch(k, replicas * BATCH)
        total = []
        for i, s, t in zip(idx.chunk(parts), scale.chunk(parts), target.chunk(parts)):
            loss = _loss(model(i, s), t)
            (loss / parts).backward()
            total.append(loss.item())
        opt.step()
        losses.append(sum(total) / parts)
    idx, scale, target = _batch(0)
    with torch.no_grad():
        evaluated = (
            sum(
                _loss(model(i, s), t).item()
                for i, s, t in zip(
                    idx.chunk(MICROBATCHES), scale.chunk(MICROBATCHES), target.chunk(MICROBATCHES)
                )
            )
            / MICROBATCHES
        )
    return losses, evaluated, model.state_dict()


@pytest.mark.distributed
def test_chunked_pipelines_train_like_one_process_with_a_tied_embedding() -> None:
    results = [r.value for r in spawn(_job, 2, timeout=300)]
    losses, evaluated, state = _one_process()
    assert losses[2] < losses[0]
    for config in SCHEDULES:
        name = config["pipeline"]
        placed = results[0][name]["stage_ranks"]
        assert placed == (
            [0, 1, 0, 1] if name == "interleaved-1f1b" else [0, 1, 1, 0]
        )  # 2 stages per process
        for got in results:
            mine = got[name]
            torch.testing.assert_close(mine["losses"], losses, rtol=1e-5, atol=1e-6)
            assert mine["eval"] == pytest.approx(evaluated, rel=1e-5) and mine["grads_untouched"]
            assert mine["state_dict"].keys() == state.keys()
            for key, value in mine["state_dict"].items():
                torch.testing.assert_close(
                    value, state[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key}"
                )
        # the original keys on each rank (ZBV's rank 0 holds the first and the last stage: both uses of the tie)
        keys = [set(got[name]["local_keys"]) for got in results]
        assert keys[0] | keys[1] == set(state) and "emb.weight" in keys[0]


# 2 partitions x 2 replicas; interleaved-1f1b also shards the optimizer state over the replicas (ZeRO)
DDP_SCHEDULES = (
    {"pipeline": "zbv"},
    {"pipeline": "interleaved-1f1b", "shard": "optimizer"},
    {"pipeline": "dualpipev"},
)
REPLICAS = 2


def _ddp_job(rank: int, world: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for config in DDP_SCHEDULES:
        api.init({"partitions": 2, "microbatches": MICROBATCHES, "ddp": True, **config})
        model = api.DistributedModel(_build(), trace_device="cpu")
        opt = api.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9))
        mine = slice(
            api.dp_rank() * BATCH, (api.dp_rank() + 1) * BATCH
        )  # this replica's half of the batch
        losses = []
        for k in range(STEPS):
            opt.zero_grad()
            losses.append(
                _train_step(model, *(t[mine] for t in _batch(k, REPLICAS * BATCH)))
                .reduce_mean()
                .item()
            )
            opt.step()
        out[config["pipeline"]] = {
            "losses": losses,
            "dp_rank": api.dp_rank(),
            "sharded": sharded_optimizer(opt) is not None,
            "stage_ranks": list(model.manifest.stage_ranks),
            "ties": [list(t.stages) for t in model.manifest.ties],
            "state_dict": {k: v.clone() for k, v in model.state_dict().items()},
            "local": {
                k: v.clone() for k, v in model.local_state_dict().items() if k != "_smp_is_partial"
            },
        }
        api.shutdown(destroy_process_group=False)
    return out


def _check_ddp_results(results: list[dict[str, Any]]) -> None:
    losses, _, state = _one_process(REPLICAS)
    for config in DDP_SCHEDULES:
        name = config["pipeline"]
        assert [got[name]["dp_rank"] for got in results] == [0, 0, 1, 1]
        assert [got[name]["sharded"] for got in results] == [name == "interleaved-1f1b"] * len(
            results
        )
        # each replica's loss is its half's; their mean is the whole batch's
        mean = torch.tensor([results[r * 2][name]["losses"] for r in range(REPLICAS)]).mean(0)
        torch.testing.assert_close(mean, torch.tensor(losses), rtol=1e-5, atol=1e-6, msg=name)
        for rank, got in enumerate(results):
            assert got[name]["state_dict"].keys() == state.keys()
            for key, value in got[name]["state_dict"].items():
                torch.testing.assert_close(
                    value, state[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key} on {rank}"
                )
            for key, value in got[name]["local"].items():  # the parameters this process holds
                torch.testing.assert_close(
                    value, state[key], rtol=1e-5, atol=1e-6, msg=f"{name}: local {key}"
                )
        # the embedding and the output projection are two chunks: of one process under the V-shaped schedules
        # (rank 0 holds the first and the last chunk: one shared parameter there); under interleaved 1F1B of
        # whichever ranks the plan puts them on (summed across them when two)
        ranks = results[0][name]["stage_ranks"]
        ties = [(len(stages), {ranks[s] for s in stages}) for stages in results[0][name]["ties"]]
        if name == "interleaved-1f1b":
            assert [n for n, _ in ties] == [2], name
        else:
            assert ties == [(2, {0})], name


@pytest.mark.distributed
def test_chunked_pipelines_with_ddp_train_like_one_process_on_the_whole_batch() -> None:
    _check_ddp_results([r.value for r in spawn(_ddp_job, 2 * REPLICAS, timeout=300)])


def test_virtual_stages_key_is_checked_against_the_schedule() -> None:
    with pytest.raises(ConfigError, match="virtual_stages"):
        api.Config.from_dict({"partitions": 2, "pipeline": "zbv", "virtual_stages": 3})
    with pytest.raises(ConfigError, match="virtual_stages"):
        api.Config.from_dict({"partitions": 2, "pipeline": "1f1b", "virtual_stages": 2})
    assert api.Config.from_dict({"partitions": 2, "pipeline": "zbv"}).chunks_per_rank == 2
    assert (
        api.Config.from_dict({"partitions": 2, "pipeline": "zbv", "ddp": True}).check_world(4) == 2
    )
    # FSDP counts backwards through one stage per process, as in the runtime; ZeRO shards any schedule
    for pipeline in ("zbv", "interleaved-1f1b", "zb-h1"):
        with pytest.raises(
            ConfigError,
            match=f"'shard': 'full' \\(FSDP\\) runs one stage per process.*'{pipeline}'",
        ):
            api.Config.from_dict(
                {"partitions": 2, "pipeline": pipeline, "ddp": True, "shard": "full"}
            ).check_world(4)
    assert (
        api.Config.from_dict(
            {"partitions": 2, "pipeline": "zbv", "ddp": True, "shard": "optimizer"}
        ).check_world(4)
        == 2
    )
