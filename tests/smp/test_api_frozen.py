"""The seed API with frozen parameters (issue 37; Note [frozen parameters] in fxpipe.codegen.graph.ownership).

GPT-2 (examples/seed_scripts/hf_keywords.py) with its tied token embedding (``wte``, also the
head, held by both stages), its position table and its first block frozen, wrapped and trained
on 2 ranks (SGD with momentum: state per parameter) with an optimizer built over
``model.parameters()`` as users write it: equal to one process, the frozen parameters unchanged
and without optimizer state.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from seedscripts import load_script
from spawn import spawn

FROZEN = ("transformer.wte", "transformer.wpe", "transformer.h.0")


def _frozen_model(script: Any) -> torch.nn.Module:
    torch.manual_seed(0)
    model = script.build_model()
    for path in FROZEN:
        model.get_submodule(path).requires_grad_(False)
    return model


def _job(rank: int, world: int) -> dict[str, Any]:
    import fxpipe as smp

    script = load_script("hf_keywords")
    smp.init({"partitions": 2, "microbatches": 2})
    model = smp.DistributedModel(_frozen_model(script))
    optimizer = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9))
    model.train()
    losses = []
    for batch in script.batches(3, 4):
        optimizer.zero_grad()
        losses.append(script.train_step(model, batch).reduce_mean().item())
        optimizer.step()
    names = {id(p): k for k, p in model.local_named_parameters()}
    return {
        "losses": losses,
        "state_dict": model.state_dict(),
        "frozen": sorted(k for k, p in model.local_named_parameters() if not p.requires_grad),
        "with_state": sorted(names[id(p)] for p in optimizer.state if id(p) in names),
    }


@pytest.mark.distributed
def test_frozen_parameters_train_like_one_process_and_stay_as_they_were() -> None:
    results = [r.value for r in spawn(_job, 2, timeout=300)]
    script = load_script("hf_keywords")
    model = _frozen_model(script)
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    frozen = {k for k, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    opt = torch.optim.SGD(model.parameters(), lr=0.5, momentum=0.9)
    losses = []
    for batch in script.batches(3, 4):
        opt.zero_grad()
        step = []
        for m in range(2):
            out = model(**{k: v.chunk(2)[m] for k, v in batch.items()})
            (out.loss / 2).backward()
            step.append(out.loss.item())
        opt.step()
        losses.append(sum(step) / 2)
    state = model.state_dict()
    for got in results:
        torch.testing.assert_close(got["losses"], losses, rtol=1e-5, atol=1e-6)
        for key, value in got["state_dict"].items():
            torch.testing.assert_close(value, state[key], rtol=1e-5, atol=1e-6, msg=key)
            if key in frozen:
                torch.testing.assert_close(value, initial[key], rtol=0, atol=0, msg=key)
        assert got["frozen"] and set(got["frozen"]) <= frozen
        assert not set(got["with_state"]) & frozen
