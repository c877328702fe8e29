"""Tensor parallelism inside stages (``--tp``): pp x tp trains exactly as one process.

The MLP example (its linears paired in the stage's own forward), the GPT example (MLP split,
its attention, a leaf, replicated) and a transformers Llama
(GQA attention and SwiGLU split, tied embeddings replicated, the model's own loss from
``labels=``), each as 1 stage x tp 2 and 2 stages x tp 2: losses and every parameter after
3 SGD steps equal one-process training of the original model (fp32, rtol 1e-5).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from builds import EXAMPLES
from fxpipe.codegen import load_stage, write_build_dir
from fxpipe.codegen.manifest import Manifest
from fxpipe.codegen.tp_plan import TensorParallelPlan
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.runtime import PipelineRunner
from fxpipe.tracer import trace_model_file
from spawn import spawn

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
HERE = Path(__file__).resolve().parent
MODELS = {"gpt": EXAMPLES / "gpt.py", "llama": HERE / "tp_llama.py", "mlp": EXAMPLES / "mlp.py"}
BATCH, MICROBATCHES, STEPS, LR, TP = 4, 2, 3, 0.1, 2


def _build(model_file: Path, out: Path, stages: int) -> Path:
    source = load_model_file(model_file)
    traced = trace_model_file(source, BATCH // MICROBATCHES)
    plan = plan_partition(traced.profile, stages, microbatches=MICROBATCHES, schedule="1f1b")
    write_build_dir(traced, plan, out, source, batch_size=BATCH, microbatches=MICROBATCHES)
    return out


class _Builds:
    """Builds made on first use, once per module (each test names the one it needs)."""

    def __init__(self, root: Path) -> None:
        self.root, self.made = root, {}

    def __getitem__(self, key: tuple[str, int]) -> Path:
        if key not in self.made:
            name, stages = key
            self.made[key] = _build(MODELS[name], self.root / f"{name}{stages}", stages)
        return self.made[key]


@pytest.fixture(scope="module")
def builds(tmp_path_factory: pytest.TempPathFactory) -> _Builds:
    return _Builds(tmp_path_factory.mktemp("tp"))


def _call(name: str, batch: Any) -> tuple[Any, Any]:
    """(inputs, targets) of one step."""
    if name == "llama":
        import tp_llama

        return tp_llama.example_inputs(batch), None  # a keyword call
    source = load_model_file(MODELS[name])
    return source.example_inputs(batch), source.example_targets(batch)


def _train(rank: int, world: int, build: Path, name: str) -> tuple[list[float], dict, int, Any]:
    from torch.distributed.tensor import DTensor

    dist.init_process_group("gloo")
    source = load_model_file(MODELS[name])
    inputs, targets = _call(name, BATCH)
    runner = PipelineRunner(
        build,
        source.loss_fn if name != "llama" else None,
        microbatches=MICROBATCHES,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        timeout_s=120,
        tensor_parallel=TP,
    )
    logits: set[str] = set()  # the loss stage's outputs that are DTensors, as the loss gets them
    last = runner.manifest.num_stages - 1
    if last in runner.stages:
        runner.stages[last].register_forward_hook(
            lambda m, a, out: logits.update(
                f"{tuple(o.shape)} {o.placements} {tuple(o.to_local().shape)}"
                for o in (out if isinstance(out, tuple) else (out,))
                if isinstance(o, DTensor)
            )
        )
    losses = [runner.step(inputs, targets) for _ in range(STEPS)]
    state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    split = sum(1 for p in runner.stage.parameters() if type(p).__name__ != "Parameter")
    vocab = runner.vocab_loss.parallel if runner.vocab_loss is not None else None
    runner.close()
    return losses, state, split, (sorted(logits), vocab)


def _reference(name: str, build: Path, stages: int, bf16: bool = False) -> tuple[list[float], dict]:
    """One process on the build's weights, the same microbatches and steps; ``bf16``: the
    forward and loss under CPU bf16 autocast, as ``precision="bf16"`` runs a stage."""
    source = load_model_file(MODELS[name])
    model = source.build_model()
    state: dict[str, torch.Tensor] = {}
    for i in range(stages):
        state.update(load_stage(build, i).state_dict())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    inputs, targets = _call(name, BATCH)
    if name != "llama":
        chunks = [
            ((x,), {}, t)
            for x, t in zip(inputs[0].chunk(MICROBATCHES), targets.chunk(MICROBATCHES))
        ]
    else:
        parts = {k: v.chunk(MICROBATCHES) for k, v in inputs.items()}
        chunks = [((), {k: v[i] for k, v in parts.items()}, None) for i in range(MICROBATCHES)]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for args, kwargs, tgt in chunks:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
                out = model(*args, **kwargs)
                loss = source.loss_fn(out, tgt) if name != "llama" else out.loss
            loss = loss.float()
            (loss / MICROBATCHES).backward()
            total += loss.item()
        opt.step()
        losses.append(total / MICROBATCHES)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("stages", [1, 2])
def test_pp_x_tp_trains_like_one_process(builds: _Builds, name: str, stages: int) -> None:
    build = builds[(name, stages)]
    plan = TensorParallelPlan.from_json(build / "tp_plan.json")
    assert all(s.for_degree(TP).styles for s in plan.stages)  # every stage really splits something
    results = [r.value for r in spawn(_train, stages * TP, build, name, timeout=600)]
    want_losses, want_state = _reference(name, build, Manifest.from_json(build).num_stages)
    assert want_losses[-1] < want_losses[0]
    seen: set[str] = set()
    vocab = {"gpt": 64, "llama": 96, "mlp": 10}[name]  # the LM head's (the classifier's) outputs
    mb = BATCH // MICROBATCHES
    shape = {"gpt": (mb, 16, vocab), "llama": (mb, 16, vocab), "mlp": (mb, vocab)}[name]
    sharded = f"{shape} (Shard(dim={len(shape) - 1}),) {(*shape[:-1], vocab // TP)}"
    for rank, (losses, state, split, (logits, parallel)) in enumerate(results):
        assert split > 0, f"rank {rank} holds no split parameter"
        if rank >= (stages - 1) * TP:  # the loss stage: logits sharded, never gathered
            assert logits == [sharded] and parallel is True, (rank, logits, parallel)
        torch.testing.assert_close(
            torch.tensor(losses),
            torch.tensor(want_losses),
            rtol=1e-5,
            atol=1e-6,
            msg=f"{name}: losses on rank {rank}",
        )
        for key, value in state.items():
            torch.testing.assert_close(
                value, want_state[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key} on rank {rank}"
            )
        seen.update(state)
    assert seen <= set(want_state)
    for key in set(want_state) - seen:  # a tied key the build holds once
        assert any(torch.equal(want_state[key], want_state[k]) for k in seen), key


REPLICAS = 2


def _train_replicas(rank: int, world: int, build: Path) -> tuple[list[float], dict, int]:
    """pp 1 x dp 2 x tp 2: replica r trains on its half of a batch of REPLICAS x BATCH."""
    dist.init_process_group("gloo")
    source = load_model_file(MODELS["gpt"])
    runner = PipelineRunner(
        build,
        source.loss_fn,
        microbatches=MICROBATCHES,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        timeout_s=120,
        tensor_parallel=TP,
    )
    assert runner.layout.replicas == REPLICAS and runner.data_parallel is not None
    rows = slice(runner.replica * BATCH, (runner.replica + 1) * BATCH)
    inputs = source.example_inputs(REPLICAS * BATCH)[0][rows]
    targets = source.example_targets(REPLICAS * BATCH)[rows]
    losses = [runner.step((inputs,), targets) for _ in range(STEPS)]
    state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    runner.close()
    return losses, state, runner.replica


@pytest.mark.distributed
@pytest.mark.slow
def test_tp_x_dp_trains_like_one_process_on_the_replicas_batches(
    builds: _Builds,
) -> None:
    """Every replica holds the same shard of each split parameter: DDP keeps the shards in step
    (Note [TP under DDP]); the result is one process on the concatenated batch."""
    build = builds[("gpt", 1)]
    results = [r.value for r in spawn(_train_replicas, REPLICAS * TP, build, timeout=600)]
    source = load_model_file(MODELS["gpt"])
    model = source.build_model()
    missing, _ = model.load_state_dict(load_stage(build, 0).state_dict(), strict=False)
    assert set(missing) <= {"lm_head.weight"}
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
    mean = torch.tensor([r[0] for r in results if r[2] == 0][0])
    mean = (mean + torch.tensor([r[0] for r in results if r[2] == 1][0])) / 2
    torch.testing.assert_close(mean, torch.tensor(want_losses), rtol=1e-5, atol=1e-6)
    for rank, (_, state, replica) in enumerate(results):
        for key, value in state.items():
            torch.testing.assert_close(
                value, want_state[key], rtol=1e-5, atol=1e-6, msg=f"{key} on rank {rank}"
            )
