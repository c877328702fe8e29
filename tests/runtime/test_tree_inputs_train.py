"""A model called with a dict batch (``model(batch)``, tests/zoo/models/dict_batch.py) trains on 2 ranks
exactly as one process trains it: through ``PipelineRunner`` (the first stage receives the dict's
flattened tensors) and through the seed API's ``@smp.step`` (Note [tensors inside containers] in
``fxpipe.model_inputs``). SGD, 2 steps of 2 microbatches, every loss and every parameter, fp32."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._pytree import tree_map

from spawn import spawn

MODEL = Path(__file__).resolve().parents[1] / "zoo" / "models" / "dict_batch.py"
BATCH, MICROBATCHES, STEPS, LR = 4, 2, 2, 0.1
pytestmark = pytest.mark.distributed


def _chunks(batch: Any, n: int) -> list[Any]:
    return [
        tree_map(lambda x: x.chunk(n)[i] if isinstance(x, torch.Tensor) else x, batch)
        for i in range(n)
    ]


def _one_process(model: torch.nn.Module, source: Any) -> tuple[list[float], dict[str, Any]]:
    model = copy.deepcopy(model).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    (batch,), targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for mb, tgt in zip(_chunks(batch, MICROBATCHES), targets.chunk(MICROBATCHES)):
            loss = source.loss_fn(model(mb), tgt)
            (loss / MICROBATCHES).backward()
            total += loss.item()
        opt.step()
        losses.append(total / MICROBATCHES)
    return losses, model.state_dict()


def _runner_job(rank: int, world: int, build: str) -> dict[str, Any]:
    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner

    source = load_model_file(MODEL)
    with PipelineRunner(
        build,
        source.loss_fn,
        microbatches=MICROBATCHES,
        timeout_s=120,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
    ) as runner:
        (batch,), targets = source.example_inputs(BATCH), source.example_targets(BATCH)
        flat = runner.manifest.call_spec.bind_any(batch)  # as fxpipe run's data path hands it over
        losses = [runner.step(batch, targets), runner.step(flat, targets)]  # the dict, its tensors
        return {"losses": losses, "state": dict(runner.stage.state_dict())}


def _seed_job(rank: int, world: int) -> dict[str, Any]:
    import fxpipe as smp
    from fxpipe.modelfile import load_model_file

    source = load_model_file(MODEL)

    @smp.step
    def train_step(model: Any, batch: dict[str, Any], target: torch.Tensor) -> torch.Tensor:
        loss = source.loss_fn(model(batch), target)
        model.backward(loss)
        return loss

    smp.init({"partitions": 2, "microbatches": MICROBATCHES})
    model = smp.DistributedModel(source.build_model())
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))
    model.train()
    (batch,), targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        losses.append(train_step(model, batch, targets).reduce_mean().item())
        opt.step()
    return {"losses": losses, "state": dict(model.state_dict())}


def _check(results: list[dict[str, Any]], want: tuple[list[float], dict[str, Any]]) -> None:
    losses, state = want
    got = {}
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(losses))
        got.update(r["state"])
    assert got.keys() == state.keys()
    for key, value in got.items():
        torch.testing.assert_close(value, state[key], msg=key)
    assert losses[-1] < losses[0]


def test_a_dict_batch_trains_on_2_ranks_like_one_process(tmp_path: Path) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    source = load_model_file(MODEL)
    traced = trace_model_file(source, BATCH // MICROBATCHES, progress=False)
    plan = plan_partition(traced.profile, 2, microbatches=MICROBATCHES, time_limit=2.0)
    build = tmp_path / "build"
    write_build_dir(traced, plan, build, source, batch_size=BATCH, microbatches=MICROBATCHES)
    results = [r.value for r in spawn(_runner_job, 2, str(build), timeout=240)]
    _check(results, _one_process(source.build_model(), source))


def test_a_dict_batch_trains_through_the_seed_api_like_one_process() -> None:
    from fxpipe.modelfile import load_model_file

    source = load_model_file(MODEL)
    results = [r.value for r in spawn(_seed_job, 2, timeout=240)]
    _check(results, _one_process(source.build_model(), source))
