"""FSDP over the replicas of a tensor-parallel stage (``--tp T --shard full``), torchtitan's
composition: ``parallelize_module`` on the ``tp`` dim of the stage's ``(dp, tp)`` mesh first,
then ``fully_shard`` over its ``dp`` dim (Note [FSDP over TP]).

1 stage x tp 2 x dp 2 (4 gloo processes) of the GPT example: its split weights are DTensors
on the 2-D mesh, sharded over dp and tp; replica r trains on its half of the batch, and the
losses and every parameter (gathered) after 3 SGD steps equal one process on the whole batch
(fp32, rtol 1e-5). One process on a 1 x 1 x 1 mesh checks the composition itself cheaply.
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
from fxpipe.runtime.dataparallel import DataParallelOptions
from spawn import spawn
from test_tensor_parallel import BATCH, LR, MICROBATCHES, MODELS, STEPS, TP, _build, _call

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
REPLICAS = 2
TIGHT = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tpfsdp")
    return {name: _build(MODELS[name], root / f"{name}1", 1) for name in ("gpt", "llama")}


def _layouts(runner: PipelineRunner) -> set[str]:
    """The meshes and placements of the stage's parameters, as FSDP left them."""
    return {
        f"{p.device_mesh.mesh_dim_names} {p.placements}"
        for p in runner.stage.parameters()
        if isinstance(p, DTensor)
    }


def _sharded(rank: int, world: int, build: Path, name: str, shard: str) -> dict[str, Any]:
    """pp 1 x tp 2 x dp 2: replica r trains on its half of a batch of REPLICAS x BATCH."""
    from fxpipe.runtime.dataparallel.sharded import ShardedStage

    dist.init_process_group("gloo")
    source = load_model_file(MODELS[name])
    runner = PipelineRunner(
        build,
        source.loss_fn if name != "llama" else None,
        microbatches=MICROBATCHES,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        timeout_s=300,
        tensor_parallel=TP,
        data_parallel=DataParallelOptions(shard=shard),
    )
    assert runner.layout.replicas == REPLICAS
    assert isinstance(runner.data_parallel, ShardedStage)
    inputs, targets = _call(name, REPLICAS * BATCH)
    rows = slice(runner.replica * BATCH, (runner.replica + 1) * BATCH)
    if name == "llama":
        inputs = {k: v[rows] for k, v in inputs.items()}
    else:
        inputs, targets = (inputs[0][rows],), targets[rows]
    losses = [runner.step(inputs, targets) for _ in range(STEPS)]
    layouts = _layouts(runner)
    state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    runner.close()
    return {"losses": losses, "state": state, "replica": runner.replica, "layouts": layouts}


def _reference(build: Path, name: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the replicas' batches together, REPLICAS x MICROBATCHES chunks."""
    source = load_model_file(MODELS[name])
    model = source.build_model()
    missing, _ = model.load_state_dict(load_stage(build, 0).state_dict(), strict=False)
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, targets = _call(name, REPLICAS * BATCH)
    n = REPLICAS * MICROBATCHES
    if name == "llama":
        parts = {k: v.chunk(n) for k, v in inputs.items()}
        chunks = [((), {k: v[i] for k, v in parts.items()}, None) for i in range(n)]
    else:
        chunks = [((x,), {}, t) for x, t in zip(inputs[0].chunk(n), targets.chunk(n))]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for args, kwargs, tgt in chunks:
            out = model(*args, **kwargs)
            loss = out.loss if name == "llama" else source.loss_fn(out, tgt)
            (loss / n).backward()
            total += loss.item()
        opt.step()
        losses.append(total / n)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check(results: list[dict[str, Any]], want_losses: list[float], want_state: dict) -> None:
    by_replica = {r["replica"]: r["losses"] for r in results}
    mean = (torch.tensor(by_replica[0]) + torch.tensor(by_replica[1])) / 2
    torch.testing.assert_close(mean, torch.tensor(want_losses), **TIGHT)
    seen: set[str] = set()
    for rank, r in enumerate(results):
        for key, value in r["state"].items():
            torch.testing.assert_close(
                value,
                want_state[key],
                **TIGHT,
                msg=lambda m, key=key, rank=rank: f"{key} rank {rank}: {m}",
            )
        seen.update(r["state"])
    assert {k for k in want_state if k != "lm_head.weight"} <= seen


@pytest.mark.distributed
@pytest.mark.parametrize("name, shard", [("gpt", "full"), ("llama", "full")])
def test_fsdp_over_tp_trains_as_one_process(builds: dict[str, Path], name: str, shard: str) -> None:
    build = builds[name]
    results = [r.value for r in spawn(_sharded, TP * REPLICAS, build, name, shard, timeout=900)]
    for r in results:  # split weights on the 2-D mesh: dp shards the tp shard
        assert "('dp', 'tp') (Shard(dim=0), Shard(dim=1))" in r["layouts"], r["layouts"]
    _check(results, *_reference(build, name))
