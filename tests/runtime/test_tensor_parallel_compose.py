"""Tensor parallelism composed with the rest of a training run, each against one process.

2 stages x tp 2 (4 gloo processes) of the GPT example (its MLP split, attention and tied
embeddings replicated): gradient clipping counts each DTensor shard once (the norm and the
clipped training equal ``torch.nn.utils.clip_grad_norm_`` in one process; Note [norm of
tensor-parallel gradients]); fp16's found-inf flag of one tp rank's shard skips the step on
every rank (ranks of the other tp index and the other stage included). A model-keyed DCP
checkpoint (``fxpipe.runtime.train.dcp_checkpoint``) saved at 2 stages x tp 2, AdamW's
moments split with the weights, resumes at 2 stages x tp 1 and at 1 stage x tp 2 on the
one-process trajectory. 2 stages x tp 2 x dp 2 (8 processes, in make test-heavy) trains as
one process on the replicas' batches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fxpipe.codegen import load_stage
from fxpipe.modelfile import load_model_file
from fxpipe.runtime import PipelineRunner
from spawn import spawn
from test_tensor_parallel import BATCH, LR, MICROBATCHES, MODELS, STEPS, TP, _build

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
STAGES = 2
MAX_NORM = 0.5
TIGHT = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build(MODELS["gpt"], tmp_path_factory.mktemp("tpc") / "gpt2", STAGES)


def _runner(build: Path, **options: Any) -> tuple[PipelineRunner, Any, Any]:
    source = load_model_file(MODELS["gpt"])
    runner = PipelineRunner(
        build,
        source.loss_fn,
        microbatches=MICROBATCHES,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        timeout_s=120,
        tensor_parallel=TP,
        **options,
    )
    return runner, source.example_inputs(BATCH), source.example_targets(BATCH)


def _reference(build: Path, max_norm: float | None) -> tuple[list[float], list[float], dict]:
    source = load_model_file(MODELS["gpt"])
    model = source.build_model()
    state: dict[str, torch.Tensor] = {}
    for i in range(STAGES):
        state.update(load_stage(build, i).state_dict())
    model.load_state_dict(state, strict=False)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = source.example_inputs(BATCH)[0], source.example_targets(BATCH)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for xc, yc in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            loss = source.loss_fn(model(xc), yc)
            (loss / MICROBATCHES).backward()
            total += loss.item()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(total / MICROBATCHES)
    return losses, norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _clipped(rank: int, world: int, build: Path) -> tuple[list[float], list[float], dict]:
    dist.init_process_group("gloo")
    runner, inputs, targets = _runner(build, max_grad_norm=MAX_NORM)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(runner.step(inputs, targets))
        norms.append(runner.last_grad_norm)
    state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    runner.close()
    return losses, norms, state


@pytest.mark.distributed
def test_clipping_counts_each_shard_once(gpt2: Path) -> None:
    want_losses, want_norms, want_state = _reference(gpt2, MAX_NORM)
    assert min(want_norms) > MAX_NORM  # every step really clips
    for rank, r in enumerate(spawn(_clipped, STAGES * TP, gpt2, timeout=600)):
        losses, norms, state = r.value
        torch.testing.assert_close(
            torch.tensor(norms), torch.tensor(want_norms), **TIGHT, msg=f"norms on rank {rank}"
        )
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(want_losses), **TIGHT, msg=f"rank {rank}"
        )
        for key, value in state.items():
            torch.testing.assert_close(
                value,
                want_state[key],
                **TIGHT,
                msg=lambda m, key=key, rank=rank: f"{key} rank {rank}: {m}",
            )


POISONED = 2


def _overflow(rank: int, world: int, build: Path) -> list[dict[str, Any]]:
    """fp16; at step POISONED only rank 1 (stage 0, tp 1) makes its shard of a split gradient inf."""
    from fxpipe.runtime.pipeline.precision import PipelineScaler

    dist.init_process_group("gloo")
    runner, inputs, targets = _runner(build, precision="fp16")
    runner.scaler = PipelineScaler(runner.device, runner.optimizer)  # 2**16: no natural overflow
    step = {"k": -1}
    split = [p for p in runner.stage.parameters() if isinstance(p, DTensor)]
    assert any(not all(pl.is_replicate() for pl in p.placements) for p in split)
    if rank == 1:
        split[0].register_hook(lambda g: g * float("inf") if step["k"] == POISONED else g)
    return scaled_steps(runner, inputs, targets, step)


def scaled_steps(
    runner: Any, inputs: Any, targets: Any, step: dict[str, int], steps: int = 4
) -> list[dict[str, Any]]:
    """``steps`` fp16 steps (``step["k"]`` says which is running, for a poisoning hook), each's
    loss scale, skipped count and whether any parameter moved; the runner closed after."""
    rows = []
    for k in range(steps):
        step["k"] = k
        before = runner.state_dict()
        runner.step(inputs, targets)
        after = runner.state_dict()
        rows.append(
            {
                "scale": runner.scaler.scale,
                "skipped": runner.scaler.skipped,
                "moved": any(not torch.equal(v, after[n]) for n, v in before.items()),
            }
        )
    runner.close()
    return rows


@pytest.mark.distributed
def test_fp16_inf_in_one_tp_shard_skips_the_step_on_every_rank(gpt2: Path) -> None:
    for rank, r in enumerate(spawn(_overflow, STAGES * TP, gpt2, timeout=600)):
        rows = r.value
        assert [x["skipped"] for x in rows] == [k == POISONED for k in range(4)], rank
        assert [x["moved"] for x in rows] == [k != POISONED for k in range(4)], rank
        assert [x["scale"] for x in rows] == [2.0**16, 2.0**16, 2.0**15, 2.0**15], rank


HALF = 3


def _momentum_factory() -> Any:
    """SGD with momentum: optimizer state split with the weights, and updates linear in the
    gradients (Adam's normalisation turns reduction-order round-off of near-zero gradients into
    1e-6 differences of a few elements)."""
    return lambda params: torch.optim.SGD(params, lr=LR, momentum=0.9)


def _checkpointed(
    rank: int, world: int, build: Path, ckdir: str, tp: int, resume: bool
) -> dict[str, Any]:
    from fxpipe.runtime.train.commit import read_record
    from fxpipe.runtime.train.dcp_checkpoint import (
        check_dcp_keys,
        load_dcp_checkpoint,
        save_dcp_checkpoint,
    )

    dist.init_process_group("gloo")
    source = load_model_file(MODELS["gpt"])
    runner = PipelineRunner(
        build,
        source.loss_fn,
        microbatches=MICROBATCHES,
        optimizer_factory=_momentum_factory(),
        timeout_s=120,
        tensor_parallel=tp,
    )
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    first, history = 0, {"losses": []}
    if resume:
        record = read_record(Path(ckdir) / "checkpoint.json")
        assert record is not None
        check_dcp_keys(runner, ckdir, record)
        got = load_dcp_checkpoint(runner, ckdir, record)
        first, history = got["step"], got["history"]
    for _ in range(HALF):
        history["losses"].append(runner.step(inputs, targets))
    if not resume:
        save_dcp_checkpoint(ckdir, runner, first + HALF, (first + HALF) * BATCH, history, {})
    state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    runner.close()
    return {"losses": history["losses"], "state": state}


def _momentum_reference(build: Path) -> tuple[list[float], dict]:
    source = load_model_file(MODELS["gpt"])
    model = source.build_model()
    state: dict[str, torch.Tensor] = {}
    for i in range(STAGES):
        state.update(load_stage(build, i).state_dict())
    model.load_state_dict(state, strict=False)
    model.train()
    opt = _momentum_factory()(list(model.parameters()))
    x, y = source.example_inputs(BATCH)[0], source.example_targets(BATCH)
    losses = []
    for _ in range(2 * HALF):
        opt.zero_grad()
        total = 0.0
        for xc, yc in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            loss = source.loss_fn(model(xc), yc)
            (loss / MICROBATCHES).backward()
            total += loss.item()
        opt.step()
        losses.append(total / MICROBATCHES)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.distributed
@pytest.mark.parametrize("stages, tp", [(2, 1), (1, 2)])
def test_checkpoint_at_pp2_tp2_resumes_at_another_layout(
    gpt2: Path, tmp_path: Path, stages: int, tp: int
) -> None:
    want_losses, want_state = _momentum_reference(gpt2)
    ck = str(tmp_path / "ck")
    for r in spawn(_checkpointed, STAGES * TP, gpt2, ck, TP, False, timeout=600):
        torch.testing.assert_close(
            torch.tensor(r.value["losses"]), torch.tensor(want_losses[:HALF]), **TIGHT
        )
    build = gpt2 if stages == STAGES else _build(MODELS["gpt"], tmp_path / "b", stages)
    seen: set[str] = set()
    for rank, r in enumerate(spawn(_checkpointed, stages * tp, build, ck, tp, True, timeout=600)):
        torch.testing.assert_close(
            torch.tensor(r.value["losses"]), torch.tensor(want_losses), **TIGHT, msg=f"rank {rank}"
        )
        for key, value in r.value["state"].items():
            torch.testing.assert_close(
                value,
                want_state[key],
                **TIGHT,
                msg=lambda m, key=key, rank=rank: f"{key} rank {rank}: {m}",
            )
        seen.update(r.value["state"])
    assert {k for k in want_state if k != "lm_head.weight"} <= seen  # tied to the embedding


REPLICAS = 2


def _three_d(rank: int, world: int, build: Path) -> tuple[list[float], dict, int]:
    """pp 2 x tp 2 x dp 2: replica r trains on its half of a batch of REPLICAS x BATCH."""
    dist.init_process_group("gloo")
    source = load_model_file(MODELS["gpt"])
    runner, _, _ = _runner(build)
    assert runner.layout.replicas == REPLICAS and runner.data_parallel is not None
    assert (runner.pipeline_rank, runner.tp_rank) == ((rank // TP) % STAGES, rank % TP)
    rows = slice(runner.replica * BATCH, (runner.replica + 1) * BATCH)
    inputs = source.example_inputs(REPLICAS * BATCH)[0][rows]
    targets = source.example_targets(REPLICAS * BATCH)[rows]
    losses = [runner.step((inputs,), targets) for _ in range(STEPS)]
    state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    runner.close()
    return losses, state, runner.replica


@pytest.mark.distributed
def test_pp2_x_tp2_x_dp2_trains_as_one_process(gpt2: Path) -> None:
    results = [
        r.value for r in spawn(_three_d, STAGES * TP * REPLICAS, gpt2, timeout=900, heavy=True)
    ]
    source = load_model_file(MODELS["gpt"])
    model = source.build_model()
    state: dict[str, torch.Tensor] = {}
    for i in range(STAGES):
        state.update(load_stage(gpt2, i).state_dict())
    model.load_state_dict(state, strict=False)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    x, y = source.example_inputs(REPLICAS * BATCH)[0], source.example_targets(REPLICAS * BATCH)
    chunks = REPLICAS * MICROBATCHES
    want_losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for xc, yc in zip(x.chunk(chunks), y.chunk(chunks)):
            loss = source.loss_fn(model(xc), yc)
            (loss / chunks).backward()
            total += loss.item()
        opt.step()
        want_losses.append(total / chunks)
    want_state = model.state_dict()
    by_replica = {replica: losses for losses, _, replica in results}
    mean = (torch.tensor(by_replica[0]) + torch.tensor(by_replica[1])) / 2
    torch.testing.assert_close(mean, torch.tensor(want_losses), **TIGHT)
    seen: set[str] = set()
    for rank, (_, got, _) in enumerate(results):
        for key, value in got.items():
            torch.testing.assert_close(
                value,
                want_state[key],
                **TIGHT,
                msg=lambda m, key=key, rank=rank: f"{key} rank {rank}: {m}",
            )
        seen.update(got)
    assert {k for k in want_state if k != "lm_head.weight"} <= seen  # tied to the embedding
