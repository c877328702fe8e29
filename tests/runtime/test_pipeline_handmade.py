"""Pipelined training of a hand-split 3-stage model equals one-process training."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import handmade
from fxpipe.errors import ConfigError
from fxpipe.runtime import PipelineRunner
from reference import reference_train
from spawn import spawn

CONFIGS = [("gpipe", 2, True), ("1f1b", 4, True), ("1f1b", 2, False)]
STEPS, LR, BATCH = 3, 0.5, 8


def _train_job(rank: int, world: int) -> dict:
    dist.init_process_group("gloo")
    inputs, target = handmade.example_batch(BATCH)
    out: dict = {}
    runners = {}
    for schedule, m, average in CONFIGS:
        runner = PipelineRunner(
            handmade.manifest(),
            handmade.loss_fn,
            stage_loader=handmade.stage_loader(),
            schedule=schedule,
            microbatches=m,
            optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
            average_microbatch_grads=average,
            timeout_s=60,
        )
        runners[m] = runner
        losses = [runner.step(inputs, target) for _ in range(STEPS)]
        out[(schedule, m, average)] = (
            losses,
            {k: v.clone() for k, v in runner.stage.state_dict().items()},
        )
    uneven_inputs, uneven_target = handmade.example_batch(6)
    runner = runners[4]
    try:
        runner.step(uneven_inputs, uneven_target)
    except ConfigError as exc:
        out["uneven"] = str(exc)
    out["after_refusal"] = runner.step(inputs, target)  # the job is still usable
    dist.destroy_process_group()
    return out


@pytest.mark.distributed
def test_three_stage_training_matches_one_process() -> None:
    results = [r.value for r in spawn(_train_job, 3, timeout=180)]
    model = handmade.build_reference()
    inputs, target = handmade.example_batch(BATCH)
    for schedule, m, average in CONFIGS:
        want_losses, want_state = reference_train(
            model, inputs, target, handmade.loss_fn, STEPS, m, LR, average
        )
        for rank, res in enumerate(results):
            losses, state = res[(schedule, m, average)]
            torch.testing.assert_close(
                torch.tensor(losses),
                torch.tensor(want_losses),
                msg=f"{schedule} M={m} average={average} rank {rank} losses",
            )
            for key, value in state.items():  # includes both tied copies of emb.weight
                torch.testing.assert_close(
                    value,
                    want_state[key],
                    msg=f"{schedule} M={m} average={average} {key} on rank {rank}",
                )
    summed = reference_train(model, inputs, target, handmade.loss_fn, STEPS, 2, LR, average=False)[
        1
    ]
    averaged = reference_train(model, inputs, target, handmade.loss_fn, STEPS, 2, LR, average=True)[
        1
    ]
    assert not torch.allclose(
        summed["l1.weight"], averaged["l1.weight"]
    )  # the two modes really differ
    for res in results:
        assert "batch size 6 does not split into 4 equal microbatches" in res["uneven"]
        assert "[1, 2, 3, 6]" in res["uneven"]
        assert res["after_refusal"] == results[0]["after_refusal"]
