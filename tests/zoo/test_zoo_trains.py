"""Zoo models train on 2 ranks exactly as one process trains the original (issue 10).

A CNN with BatchNorm and in-place ops (``regnet``: RegNetY blocks, running statistics move every
microbatch), a Hugging Face decoder with RoPE and grouped-query attention (``llama``) and the same
decoder with LoRA adapters on a frozen base (``llama_lora``: the base stays as it was, frozen
parameters are in no optimizer and get no gradient), partitioned at
2 stages as ``fxpipe partition`` does, then trained by ``PipelineRunner`` on 2 ranks (SGD,
2 steps of 2 microbatches) against one process on the same microbatches
(``tests/runtime/reference.py``): every step's loss and every parameter and buffer
afterwards, fp32. Models without dropout, so both sides compute one function, and well
conditioned in fp32: the zoo's ResNets end in 1x1 feature maps, where BatchNorm over a
microbatch of 2 makes fp32 and fp64 training differ by 0.07 in the parameters after 2 steps,
so no order of summation could match them to fp32 tolerance (RegNet: 7e-7). The encoder-
decoder (BART) and GPT-2 trained on their own ``labels=`` loss are in
``tests/runtime/test_own_loss.py``. These run with the full zoo (``FXPIPE_ZOO=full``, ``make zoo``).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE, HERE.parent / "runtime"):
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from reference import reference_train  # noqa: E402
from registry import ZooModel, select  # noqa: E402
from spawn import spawn  # noqa: E402

FULL = os.environ.get("FXPIPE_ZOO") == "full"
STAGES, BATCH, MICROBATCHES, STEPS, LR = 2, 4, 2, 2, 0.1
pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.skipif(not FULL, reason="the whole zoo runs with FXPIPE_ZOO=full (make zoo)"),
]


def _train_job(rank: int, world: int, build: str, spec: str) -> dict[str, Any]:
    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner

    source = load_model_file(spec)
    inputs, targets = source.example_inputs(BATCH), source.example_targets(BATCH)
    with PipelineRunner(
        build,
        source.loss_fn,
        microbatches=MICROBATCHES,
        timeout_s=120,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
    ) as runner:
        losses = [runner.step(inputs, targets) for _ in range(STEPS)]
        names = {id(p): k for k, p in runner.stage.named_parameters()}
        optimized = [] if runner.optimizer is None else runner.optimizer.param_groups
        return {
            "losses": losses,
            "state": {k: v.detach().clone() for k, v in runner.stage.state_dict().items()},
            "frozen": sorted(k for k, p in runner.stage.named_parameters() if not p.requires_grad),
            "optimized": sorted(names[id(p)] for g in optimized for p in g["params"]),
            "grads": sorted(k for k, p in runner.stage.named_parameters() if p.grad is not None),
        }


@pytest.mark.parametrize("model", select(["regnet", "llama", "llama_lora"]), ids=lambda m: m.name)
def test_zoo_model_trains_on_2_ranks_like_one_process(tmp_path: Path, model: ZooModel) -> None:
    from compare import reference_model

    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import CostModel, plan_partition
    from fxpipe.tracer import trace_model_file

    source = load_model_file(model.spec)
    traced = trace_model_file(source, BATCH // MICROBATCHES, progress=False)
    plan = plan_partition(
        traced.profile,
        STAGES,
        microbatches=MICROBATCHES,
        time_limit=2.0,
        cost=CostModel.preset("loopback", optimizer="sgd"),
    )
    build = tmp_path / "build"
    write_build_dir(traced, plan, build, source, batch_size=BATCH, microbatches=MICROBATCHES)

    want_losses, want_state = reference_train(
        reference_model(build, source),
        source.example_inputs(BATCH),
        source.example_targets(BATCH),
        source.loss_fn,
        STEPS,
        MICROBATCHES,
        LR,
    )
    results = [r.value for r in spawn(_train_job, 2, str(build), model.spec, timeout=300)]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want_losses))
    state = {**results[0]["state"], **results[1]["state"]}
    assert state and set(state) <= set(want_state)
    for key, value in state.items():
        torch.testing.assert_close(value, want_state[key], msg=key)
    assert want_losses[-1] < want_losses[0]
    original = source.build_model()
    frozen = {k for k, p in original.named_parameters() if not p.requires_grad}
    assert sorted(k for r in results for k in r["frozen"]) == sorted(frozen)
    for r in results:  # frozen parameters: not in the optimizer, no gradient
        assert not set(r["optimized"]) & frozen and not set(r["grads"]) & frozen
    initial = reference_model(build, source).state_dict()
    for key in frozen:  # the base is unchanged by training
        torch.testing.assert_close(state[key], initial[key], rtol=0, atol=0, msg=key)
