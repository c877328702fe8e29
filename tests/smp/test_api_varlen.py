"""``@smp.step`` called with another sequence length every step, on a build with a dynamic sequence
dimension (#36): the seed example ``examples/seed_scripts/bucketed_finetune.py`` (length-bucketed
text, ``DistributedModel(..., dynamic_dims=...)``) on 2 ranks trains equal to one process (fp32), and
its documented command runs."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from seedscripts import SCRIPTS, load_script
from spawn import spawn

STEPS, BATCH, MICROBATCHES = 5, 4, 2
TIGHT = {"rtol": 1e-5, "atol": 1e-6}


def _job(rank: int, world: int) -> dict[str, Any]:
    return load_script("bucketed_finetune").main(
        {"partitions": 2, "microbatches": MICROBATCHES}, steps=STEPS, batch_size=BATCH
    )


def _one_process() -> tuple[list[float], dict[str, torch.Tensor]]:
    script = load_script("bucketed_finetune")
    torch.manual_seed(0)
    model = script.build_model().train()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for batch in script.batches(STEPS, BATCH):
        opt.zero_grad()
        total = 0.0
        for m in range(MICROBATCHES):
            out = model(**{k: v.chunk(MICROBATCHES)[m] for k, v in batch.items()})
            (out.loss / MICROBATCHES).backward()
            total += out.loss.item()
        opt.step()
        losses.append(total / MICROBATCHES)
    return losses, model.state_dict()


@pytest.mark.distributed
def test_a_new_length_every_step_trains_like_one_process() -> None:
    results = [r.value for r in spawn(_job, 2, timeout=400)]
    losses, state = _one_process()
    lengths = results[0]["lengths"]
    assert len(set(lengths)) == len(lengths) == STEPS, lengths  # every step another length
    for got in results:
        torch.testing.assert_close(got["losses"], losses, **TIGHT)
        assert got["state_dict"].keys() <= state.keys() and got["state_dict"]
        for key, value in got["state_dict"].items():
            torch.testing.assert_close(value, state[key], **TIGHT, msg=key)


@pytest.mark.distributed
def test_the_documented_command_runs_two_steps() -> None:
    root = SCRIPTS.parents[1]
    env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    # the docstring's command: torchrun --standalone --nproc-per-node 2 <script> --steps N
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
    command += ["2", str(SCRIPTS / "bucketed_finetune.py"), "--steps", "2"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env, cwd=root)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("step ")]
    assert [line.split(",")[0] for line in lines] == ["step 1: length 16", "step 2: length 18"]
    doc = (SCRIPTS / "bucketed_finetune.py").read_text()
    assert (
        "torchrun --standalone --nproc-per-node 2 examples/seed_scripts/bucketed_finetune.py" in doc
    )
