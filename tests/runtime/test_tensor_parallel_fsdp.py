"""FSDP over the replicas of a tensor-parallel stage (``--tp T --shard grad-op|full``),
torchtitan's composition: ``parallelize_module`` on the ``tp`` dim of the stage's ``(dp, tp)``
mesh first, then ``fully_shard`` over its ``dp`` dim (Note [FSDP over TP]).

1 stage x tp 2 x dp 2 (4 gloo processes) of the GPT example and a GQA Llama (``labels=``):
split weights are DTensors on the 2-D mesh, sharded over dp and tp; replica r trains on its
half of the batch, and the losses and every parameter (gathered) after 3 SGD steps equal one
process on the whole batch (fp32, rtol 1e-5). Clipping (grad-op), fp16's found-inf and a DCP
checkpoint resumed in one process, each against one process. One process on a 1 x 1 x 1 mesh
checks the composition itself cheaply (make test).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from fxpipe.codegen import load_stage
from fxpipe.codegen.manifest import Manifest
from fxpipe.modelfile import load_model_file
from fxpipe.runtime import PipelineRunner
from fxpipe.runtime.dataparallel import DataParallelOptions
from spawn import spawn
from test_tensor_parallel import BATCH, LR, MICROBATCHES, MODELS, STEPS, TP, _Builds, _call
from test_tensor_parallel_compose import scaled_steps

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
REPLICAS = 2
TIGHT = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> _Builds:
    """Builds made on first use: (model, stages)."""
    return _Builds(tmp_path_factory.mktemp("tpfsdp"))


def _layouts(runner: PipelineRunner) -> set[str]:
    """The meshes and placements of the stage's parameters, as FSDP left them."""
    return {
        f"{p.device_mesh.mesh_dim_names} {p.placements}"
        for p in runner.stage.parameters()
        if isinstance(p, DTensor)
    }


def _runner(build: Path, name: str, shard: str, **options: Any) -> PipelineRunner:
    source = load_model_file(MODELS["gpt" if name == "gpt2" else name])
    return PipelineRunner(
        build,
        source.loss_fn if name != "llama" else None,
        microbatches=MICROBATCHES,
        optimizer_factory=options.pop("optimizer_factory", lambda p: torch.optim.SGD(p, lr=LR)),
        timeout_s=300,
        tensor_parallel=TP,
        data_parallel=DataParallelOptions(shard=shard),
        **options,
    )


def _half(runner: PipelineRunner, name: str) -> tuple[Any, Any]:
    """This replica's half of a batch of REPLICAS x BATCH."""
    inputs, targets = _call("gpt" if name == "gpt2" else name, REPLICAS * BATCH)
    rows = slice(runner.replica * BATCH, (runner.replica + 1) * BATCH)
    if name == "llama":
        return {k: v[rows] for k, v in inputs.items()}, None
    return (inputs[0][rows],), targets[rows]


def _sharded(
    rank: int,
    world: int,
    build: Path,
    name: str,
    shard: str,
    max_norm: float | None = None,
    compile: bool = False,
) -> dict[str, Any]:
    """pp x tp 2 x dp 2: replica r trains on its half of a batch of REPLICAS x BATCH."""
    from fxpipe.runtime.dataparallel.sharded import ShardedStage

    dist.init_process_group("gloo")
    runner = _runner(build, name, shard, max_grad_norm=max_norm, compile=compile)
    assert runner.layout.replicas == REPLICAS
    assert isinstance(runner.data_parallel, ShardedStage)
    inputs, targets = _half(runner, name)
    losses, norms = [], []
    for _ in range(STEPS):
        losses.append(runner.step(inputs, targets))
        norms.append(runner.last_grad_norm)
    layouts = _layouts(runner)
    local_bytes = sum(  # what this rank holds of the stage's parameters, as FSDP sharded them
        p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else p.nbytes
        for p in runner.stage.parameters()
    )
    state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    runner.close()
    return {
        "losses": losses,
        "norms": norms,
        "state": state,
        "replica": runner.replica,
        "layouts": layouts,
        "local_bytes": local_bytes,
        "tp_rank": runner.tp_rank,
        "compiled": [c.line(timed=False) for c in runner.compiled],
    }


def _reference(
    build: Path, name: str, max_norm: float | None = None, steps: int = STEPS, momentum: float = 0.0
) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One process on the replicas' batches together, REPLICAS x MICROBATCHES chunks; the
    gradient norms when clipping to ``max_norm``."""
    source = load_model_file(MODELS[name])
    model = source.build_model()
    state: dict[str, torch.Tensor] = {}
    for i in range(Manifest.from_json(build).num_stages):
        state.update(load_stage(build, i).state_dict())
    missing, _ = model.load_state_dict(state, strict=False)
    assert set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=momentum)
    inputs, targets = _call(name, REPLICAS * BATCH)
    n = REPLICAS * MICROBATCHES
    if name == "llama":
        parts = {k: v.chunk(n) for k, v in inputs.items()}
        chunks = [((), {k: v[i] for k, v in parts.items()}, None) for i in range(n)]
    else:
        chunks = [((x,), {}, t) for x, t in zip(inputs[0].chunk(n), targets.chunk(n))]
    losses, norms = [], []
    for _ in range(steps):
        opt.zero_grad()
        total = 0.0
        for args, kwargs, tgt in chunks:
            out = model(*args, **kwargs)
            loss = out.loss if name == "llama" else source.loss_fn(out, tgt)
            (loss / n).backward()
            total += loss.item()
        if max_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(total / n)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, norms


def _check(
    results: list[dict[str, Any]],
    want_losses: list[float],
    want_state: dict,
    *_: Any,
    close: dict[str, float] = TIGHT,
) -> None:
    by_replica = {r["replica"]: r["losses"] for r in results}
    mean = (torch.tensor(by_replica[0]) + torch.tensor(by_replica[1])) / 2
    torch.testing.assert_close(mean, torch.tensor(want_losses), **close)
    seen: set[str] = set()
    for rank, r in enumerate(results):
        for key, value in r["state"].items():
            torch.testing.assert_close(
                value,
                want_state[key],
                **close,
                msg=lambda m, key=key, rank=rank: f"{key} rank {rank}: {m}",
            )
        seen.update(r["state"])
    assert {k for k in want_state if k != "lm_head.weight"} <= seen


@pytest.mark.distributed
@pytest.mark.parametrize("name, shard", [("gpt", "full"), ("llama", "full")])
def test_fsdp_over_tp_trains_as_one_process(builds: _Builds, name: str, shard: str) -> None:
    build = builds[(name, 1)]
    results = [r.value for r in spawn(_sharded, TP * REPLICAS, build, name, shard, timeout=900)]
    for r in results:  # split weights on the 2-D mesh: dp shards the tp shard
        assert "('dp', 'tp') (Shard(dim=0), Shard(dim=1))" in r["layouts"], r["layouts"]
    _check(results, *_reference(build, name))
    if name == "gpt":  # the cost model prices what the ranks hold
        _check_priced_memory(build, results)


@pytest.mark.distributed
def test_fsdp_over_tp_compiled_trains_as_one_process_and_is_checked(builds: _Builds) -> None:
    """Compiled inside the FSDP units of a tensor-parallel stage (pp1 x tp2 x dp2): the warm-up's
    check runs through both collectives (Note [checking sharded stages]: verdicts exchanged over
    the 2-D mesh, one dimension at a time) and finds the stage equal to its eager code; the steps
    equal one eager process (rtol 1e-4: compiled kernels round otherwise)."""
    build = builds[("gpt", 1)]
    results = [
        r.value
        for r in spawn(_sharded, TP * REPLICAS, build, "gpt", "full", None, True, timeout=900)
    ]
    for r in results:
        assert r["compiled"] and r["compiled"][0].endswith("; equals its eager code"), r["compiled"]
    _check(results, *_reference(build, "gpt"), close={"rtol": 1e-4, "atol": 1e-5})


def _check_priced_memory(build: Path, results: list[dict[str, Any]]) -> None:
    """Note [memory of tensor-parallel shards]: the tp profile's parameter bytes are what the
    replicas of one tp index hold together, and ``shard="full"`` prices 1/R of it per rank."""
    from fxpipe.codegen.tp_plan import TensorParallelPlan
    from fxpipe.partitioner.cost import CostModel
    from fxpipe.partitioner.tensor_parallel import tensor_parallel_profile
    from fxpipe.tracer.profile import ModelProfile

    styles = TensorParallelPlan.from_json(build / "tp_plan.json").stages[0].for_degree(TP).styles
    priced = tensor_parallel_profile(
        ModelProfile.from_json(build / "profile.json"), styles, TP, 1e9, 1e-5
    )
    total = sum(priced.param_sizes.values())
    for t in range(TP):
        held = sum(r["local_bytes"] for r in results if r["tp_rank"] == t)
        assert held == total, (t, held, total)
    per_rank = CostModel(dp_replicas=REPLICAS, shard="full").stage_state_bytes(total)[0]
    assert per_rank == total // REPLICAS


MAX_NORM = 0.5


@pytest.mark.distributed
def test_clipping_under_fsdp_over_tp_counts_each_shard_once(builds: _Builds) -> None:
    """grad-op, clipped: each gradient is split over dp, tp or both; the norm adds each shard
    once over the dims it is split on (Note [norm of tensor-parallel gradients])."""
    build = builds[("gpt", 1)]
    results = [
        r.value
        for r in spawn(_sharded, TP * REPLICAS, build, "gpt", "grad-op", MAX_NORM, timeout=900)
    ]
    want_losses, want_state, want_norms = _reference(build, "gpt", MAX_NORM)
    assert min(want_norms) > MAX_NORM  # every step really clips
    for rank, r in enumerate(results):
        torch.testing.assert_close(
            torch.tensor(r["norms"]), torch.tensor(want_norms), **TIGHT, msg=f"norms rank {rank}"
        )
    _check(results, want_losses, want_state)


HALF = 2


def _momentum(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _saved(rank: int, world: int, build: Path, ckdir: str) -> list[float]:
    """pp 1 x tp 2 x dp 2, shard full: HALF steps, then a DCP checkpoint (2-D DTensor shards)."""
    from fxpipe.runtime.train.dcp_checkpoint import save_dcp_checkpoint

    dist.init_process_group("gloo")
    runner = _runner(build, "gpt", "full", optimizer_factory=_momentum)
    inputs, targets = _half(runner, "gpt")
    losses = [runner.step(inputs, targets) for _ in range(HALF)]
    save_dcp_checkpoint(ckdir, runner, HALF, HALF * BATCH, {"losses": losses}, {})
    runner.close()
    return losses


def _resumed(rank: int, world: int, build: Path, ckdir: str) -> dict[str, Any]:
    """One process (no tp, no replicas) resumes and trains on the replicas' batches together."""
    from fxpipe.runtime.train.commit import read_record
    from fxpipe.runtime.train.dcp_checkpoint import check_dcp_keys, load_dcp_checkpoint

    dist.init_process_group("gloo")
    source = load_model_file(MODELS["gpt"])
    runner = PipelineRunner(
        build,
        source.loss_fn,
        microbatches=REPLICAS * MICROBATCHES,
        optimizer_factory=_momentum,
        timeout_s=300,
    )
    record = read_record(Path(ckdir) / "checkpoint.json")
    assert record is not None
    check_dcp_keys(runner, ckdir, record)
    got = load_dcp_checkpoint(runner, ckdir, record)
    inputs, targets = _call("gpt", REPLICAS * BATCH)
    losses = [runner.step(inputs, targets) for _ in range(STEPS - HALF)]
    state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    runner.close()
    return {"step": got["step"], "losses": losses, "state": state}


@pytest.mark.distributed
def test_checkpoint_of_fsdp_over_tp_resumes_in_one_process(builds: _Builds, tmp_path: Path) -> None:
    """The model-keyed DCP checkpoint holds the 2-D shards (weights and momentum) by original
    key: one process resumes it on the one-process trajectory."""
    build, ck = builds[("gpt", 1)], str(tmp_path / "ck")
    want_losses, want_state, _ = _reference(build, "gpt", momentum=0.9)
    saved = [r.value for r in spawn(_saved, TP * REPLICAS, build, ck, timeout=900)]
    mean = (torch.tensor(saved[0]) + torch.tensor(saved[-1])) / 2  # ranks 0, 3: replicas 0, 1
    torch.testing.assert_close(mean, torch.tensor(want_losses[:HALF]), **TIGHT)
    (resumed,) = [r.value for r in spawn(_resumed, 1, build, ck, timeout=600)]
    assert resumed["step"] == HALF
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(want_losses[HALF:]), **TIGHT
    )
    for key, value in resumed["state"].items():
        torch.testing.assert_close(value, want_state[key], **TIGHT, msg=key)


def test_fsdp_over_tp_on_a_one_rank_mesh_composes(tmp_path: Path) -> None:
    """The composition in one process (make test's sibling of the 4-process runs): the stage's
    (dp, tp) mesh sliced from one root, the plan applied on tp, FSDP over dp; the split weights
    become DTensors on the 2-D mesh and outputs and gradients equal the plain module's."""
    import copy
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "codegen"))
    from test_tp_plan import Stage  # a tiny attention + SwiGLU + fused-qkv stage

    from fxpipe.codegen.tp_plan import find_stage_plan
    from fxpipe.runtime import RankLayout
    from fxpipe.runtime.dataparallel.sharded import ShardedStage
    from fxpipe.runtime.pipeline.tensor_parallel import (
        implicit_replication_on,
        parallelize_stage,
        stage_mesh,
    )

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        stage = Stage()
        plain = copy.deepcopy(stage)
        mesh = stage_mesh(RankLayout(1, 1, 1), torch.device("cpu"))
        assert mesh.mesh_dim_names == ("dp", "tp")
        parallelize_stage(stage, find_stage_plan(stage, 0).for_degree(1), mesh["tp"])
        ShardedStage(
            stage, None, DataParallelOptions(shard="full"), torch.device("cpu"), 1, mesh=mesh["dp"]
        )
        q = stage.attn.q.weight
        assert isinstance(q, DTensor) and q.device_mesh.mesh_dim_names == ("dp", "tp")
        ids = torch.randint(0, 10, (2, 5))
        mask = torch.ones(1, 1, 5, 5, dtype=torch.bool).tril()
        with implicit_replication_on():
            out = stage(ids, mask)
            out.square().mean().backward()
        want = plain(ids, mask)
        want.square().mean().backward()
        torch.testing.assert_close(out, want, **TIGHT)
        for (name, p), w in zip(stage.named_parameters(), plain.parameters()):
            assert isinstance(p.grad, DTensor), name
            torch.testing.assert_close(p.grad.full_tensor(), w.grad, **TIGHT, msg=name)
    finally:
        dist.destroy_process_group()


POISONED = 2


def _overflow(rank: int, world: int, build: Path) -> list[dict[str, Any]]:
    """fp16, shard full; at step POISONED only rank 1 (replica 0, tp 1) makes its shard of a
    split gradient inf, after FSDP's reduce-scatter."""
    from fxpipe.runtime.pipeline.precision import PipelineScaler

    dist.init_process_group("gloo")
    runner = _runner(build, "gpt", "full", precision="fp16")
    runner.scaler = PipelineScaler(runner.device, runner.optimizer)  # 2**16: no natural overflow
    inputs, targets = _half(runner, "gpt")
    step = {"k": -1}
    split = [p for p in runner.stage.parameters() if _is_2d(p)]
    dp = runner.data_parallel
    assert dp is not None and split
    sync = dp.sync_gradients

    def poisoned() -> None:
        sync()
        if rank == 1 and step["k"] == POISONED:
            split[0].grad.to_local().mul_(float("inf"))

    dp.sync_gradients = poisoned  # type: ignore[method-assign]
    return scaled_steps(runner, inputs, targets, step)


def _is_2d(p: torch.Tensor) -> bool:
    return isinstance(p, DTensor) and p.device_mesh.mesh_dim_names == ("dp", "tp")


@pytest.mark.distributed
def test_fp16_inf_in_one_shard_of_fsdp_over_tp_skips_the_step_on_every_rank(
    builds: _Builds,
) -> None:
    for rank, r in enumerate(spawn(_overflow, TP * REPLICAS, builds[("gpt", 1)], timeout=900)):
        rows = r.value
        assert [x["skipped"] for x in rows] == [k == POISONED for k in range(4)], rank
        assert [x["moved"] for x in rows] == [k != POISONED for k in range(4)], rank
        assert [x["scale"] for x in rows] == [2.0**16, 2.0**16, 2.0**15, 2.0**15], rank


@pytest.mark.distributed
def test_pp2_x_tp2_x_dp2_sharded_trains_as_one_process(builds: _Builds) -> None:
    """2 stages (the embedding and its tied head on different stages: the tie sums FSDP's 2-D
    shards) x tp 2 x dp 2, shard full: 8 processes."""
    build = builds[("gpt", 2)]
    results = [
        r.value
        for r in spawn(_sharded, 2 * TP * REPLICAS, build, "gpt2", "full", timeout=1200, heavy=True)
    ]
    _check(results, *_reference(build, "gpt"))


@pytest.mark.parametrize(
    "schedule, shard, refused",
    [
        ("zb-h1", "full", "runs one stage per rank and an unsplit backward only"),
        ("1f1b", "optimizer", "not shard='optimizer'"),
    ],
)
def test_runner_refuses_what_fsdp_over_tp_does_not_run(
    builds: _Builds,
    monkeypatch: pytest.MonkeyPatch,
    schedule: str,
    shard: str,
    refused: str,
) -> None:
    """Before any communication: a split backward (W would differentiate FSDP's whole
    parameters, tp DTensors) and ZeRO-1 over tp shards."""
    from fxpipe.errors import ConfigError

    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("MASTER_ADDR", "127.0.0.1")):
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_PORT", "29500")  # never reached: refused before any group
    monkeypatch.setenv("WORLD_SIZE", str(TP * REPLICAS))
    with pytest.raises(ConfigError, match=refused):
        PipelineRunner(
            builds[("gpt", 1)],
            None,
            microbatches=MICROBATCHES,
            schedule=schedule,
            tensor_parallel=TP,
            data_parallel=DataParallelOptions(shard=shard),
        )
