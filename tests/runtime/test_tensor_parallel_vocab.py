"""Vocabulary-parallel embeddings and LM heads under ``--tp`` (Note [vocabulary-parallel] in
fxpipe.codegen.tp_plan, Note [which losses run in parallel] in fxpipe.runtime.pipeline.loss_parallel).

pp 2 x tp 2 on the GPT example (tied embedding and head on different stages) with a ``loss_fn``
that is not a cross entropy ``loss_parallel`` computes exactly (label smoothing): its logits are
gathered whole, and training equals one process (losses and every parameter, fp32, rtol 1e-5).
(The sharded logits of a plain cross entropy and of a model's own loss are checked by
``test_tensor_parallel.py``.) A transformers Mixtral (the zoo's tiny config; fused experts replicated, attention split,
vocabulary-parallel embedding and untied head, the zoo's ``loss_fn``) as 2 stages x tp 2.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from builds import EXAMPLES
from fxpipe.codegen import load_stage, write_build_dir
from fxpipe.codegen.tp_plan import TensorParallelPlan
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.runtime import PipelineRunner
from fxpipe.tracer import trace_model_file
from spawn import spawn

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
ZOO = Path(__file__).resolve().parents[1] / "zoo" / "models"
MODELS = {"gpt": EXAMPLES / "gpt.py", "mixtral": ZOO / "mixtral.py"}
VOCAB = {"gpt": 64, "mixtral": 96}
BATCH, MICROBATCHES, STEPS, LR, TP, STAGES = 4, 2, 3, 0.1, 2, 2


def smoothed(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """A cross entropy with label smoothing: not what loss_parallel computes."""
    return F.cross_entropy(
        output.reshape(-1, output.size(-1)), target.reshape(-1), label_smoothing=0.1
    )


def _loss(name: str, loss: str) -> Any:
    return smoothed if loss == "smoothed" else load_model_file(MODELS[name]).loss_fn


def _build(name: str, out: Path) -> Path:
    source = load_model_file(MODELS[name])
    traced = trace_model_file(source, BATCH // MICROBATCHES)
    plan = plan_partition(traced.profile, STAGES, microbatches=MICROBATCHES, schedule="1f1b")
    write_build_dir(traced, plan, out, source, batch_size=BATCH, microbatches=MICROBATCHES)
    return out


def _train(rank: int, world: int, build: Path, name: str, loss: str) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Shard

    dist.init_process_group("gloo")
    source = load_model_file(MODELS[name])
    runner = PipelineRunner(
        build,
        _loss(name, loss),
        microbatches=MICROBATCHES,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
        timeout_s=120,
        tensor_parallel=TP,
    )
    seen: list[Any] = []
    last = runner.manifest.num_stages - 1
    if last in runner.stages:  # what the loss stage hands the loss: after the runtime's own hooks
        runner.stages[last].register_forward_hook(
            lambda m, a, out: seen.extend(
                (type(o).__name__, str(o.placements), tuple(o.to_local().shape))
                if isinstance(o, DTensor)
                else (type(o).__name__, "", tuple(o.shape))
                for o in (out if isinstance(out, tuple) else (out,))
            )
        )
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    losses = [runner.step(inputs, targets) for _ in range(STEPS)]
    state = {k: v.detach().clone() for k, v in runner.state_dict().items()}
    evaluated = runner.eval_step(inputs, targets)  # forward only, under loss_parallel too
    vocab = sorted(  # the modules split over the vocabulary's rows
        p
        for p, m in runner.stage.named_modules()
        if isinstance(m, (torch.nn.Embedding, torch.nn.Linear))
        and isinstance(m.weight, DTensor)
        and m.weight.placements == (Shard(0),)
        and m.weight.shape[0] == VOCAB[name]
    )
    vocab_loss = runner.vocab_loss
    result = {
        "losses": losses,
        "eval": evaluated,
        "state": state,
        "vocab": vocab,
        "outputs": sorted(set(seen)),  # every microbatch alike
        "parallel": None if vocab_loss is None else vocab_loss.parallel,
        "why": "" if vocab_loss is None else vocab_loss.why,
    }
    runner.close()
    return result


def _reference(name: str, build: Path, loss: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    source = load_model_file(MODELS[name])
    model = source.build_model()
    state: dict[str, torch.Tensor] = {}
    for i in range(STAGES):
        state.update(load_stage(build, i).state_dict())
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}  # tied to the embedding
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    loss_fn = _loss(name, loss)
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    chunks = list(zip(*(x.chunk(MICROBATCHES) for x in inputs), targets.chunk(MICROBATCHES)))
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for *xs, t in chunks:
            value = loss_fn(model(*xs), t)
            (value / MICROBATCHES).backward()
            total += value.item()
        opt.step()
        losses.append(total / MICROBATCHES)
    model.eval()
    with torch.no_grad():
        evaluated = sum(loss_fn(model(*xs), t).item() for *xs, t in chunks) / MICROBATCHES
    return [*losses, evaluated], {k: v.detach().clone() for k, v in model.state_dict().items()}


def _check(name: str, build: Path, loss: str, results: list[dict[str, Any]]) -> None:
    want_losses, want_state = _reference(name, build, loss)  # the last: eval_step's after training
    assert want_losses[STEPS - 1] < want_losses[0]
    seen: set[str] = set()
    for rank, r in enumerate(results):
        torch.testing.assert_close(
            torch.tensor([*r["losses"], r["eval"]]),
            torch.tensor(want_losses),
            rtol=1e-5,
            atol=1e-6,
            msg=f"{name}: losses on rank {rank}",
        )
        for key, value in r["state"].items():
            torch.testing.assert_close(
                value, want_state[key], rtol=1e-5, atol=1e-6, msg=f"{name}: {key} on rank {rank}"
            )
        seen.update(r["state"])
    assert seen <= set(want_state)
    for key in set(want_state) - seen:  # a tied key the build holds once
        assert any(torch.equal(want_state[key], want_state[k]) for k in seen), key


@pytest.fixture(scope="module")
def gpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _build("gpt", tmp_path_factory.mktemp("vocab") / "gpt")


@pytest.mark.distributed
@pytest.mark.slow
def test_a_loss_fn_loss_parallel_cannot_compute_gets_gathered_logits(gpt: Path) -> None:
    results = [r.value for r in spawn(_train, STAGES * TP, gpt, "gpt", "smoothed", timeout=600)]
    for r in results[2:]:
        assert r["parallel"] is False and "log_softmax of the logits feeds" in r["why"]
    _check("gpt", gpt, "smoothed", results)


@pytest.mark.distributed
@pytest.mark.slow
def test_mixtral_splits_attention_and_vocabulary_keeps_experts_and_trains_like_one_process(
    tmp_path: Path,
) -> None:
    build = _build("mixtral", tmp_path / "mixtral")
    plan = TensorParallelPlan.from_json(build / "tp_plan.json")
    kept = {k.path: k.reason for s in plan.stages for k in s.for_degree(TP).replicated}
    experts = [p for p in kept if p.endswith("mlp.experts")]
    assert experts and all("outside nn.Linear" in kept[p] for p in experts)
    assert plan.stage(1).for_degree(TP).head == "lm_head"
    results = [r.value for r in spawn(_train, STAGES * TP, build, "mixtral", "plain", timeout=600)]
    assert all(r["parallel"] is True for r in results[2:])
    _check("mixtral", build, "plain", results)
