"""The seed API with a Hugging Face loop (examples/seed_scripts/hf_keywords.py) on 2 ranks: the model
called with keyword inputs (``model(**batch)``, ``labels`` among them) and ``model.backward(out.loss)``,
against the same loop in one process (issue 10, item 7)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from seedscripts import load_script
from spawn import spawn


def _job(rank: int, world: int) -> dict[str, Any]:
    return load_script("hf_keywords").main({"partitions": 2, "microbatches": 2})


def _one_process(
    steps: int = 3, microbatches: int = 2
) -> tuple[list[float], dict[str, torch.Tensor]]:
    script = load_script("hf_keywords")
    torch.manual_seed(0)
    model = script.build_model().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for batch in script.batches(steps, 4):
        opt.zero_grad()
        step = []
        for m in range(microbatches):
            out = model(**{k: v.chunk(microbatches)[m] for k, v in batch.items()})
            (out.loss / microbatches).backward()
            step.append(out.loss.item())
        opt.step()
        losses.append(sum(step) / microbatches)
    return losses, model.state_dict()


@pytest.mark.distributed
def test_keyword_call_and_the_models_own_loss_train_like_one_process() -> None:
    results = [r.value for r in spawn(_job, 2, timeout=240)]
    losses, state = _one_process()
    for got in results:
        torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=1e-6)
        assert got["state_dict"].keys() <= state.keys() and "lm_head.weight" in got["state_dict"]
        for key, value in got["state_dict"].items():
            torch.testing.assert_close(value, state[key], rtol=1e-5, atol=1e-6, msg=key)
    assert losses[2] < losses[0]  # the first batch again, after two steps
