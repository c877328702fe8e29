"""The seed API on a model built on the meta device: each rank materialises only its stage, and training
from a loaded checkpoint equals one process that loaded the same checkpoint."""

from __future__ import annotations

import pytest
import torch
from meta_scenarios import BATCH, GPT, LR, MICROBATCHES, STEPS, meta_training_job
from oracle import train_one_process
from spawn import spawn

from fxpipe.modelfile import load_model_file


@pytest.mark.slow
def test_meta_model_trains_like_one_process_from_the_same_checkpoint(tmp_path):
    source = load_model_file(GPT)
    torch.manual_seed(11)
    checkpoint = source.build_model().state_dict()
    torch.save(checkpoint, tmp_path / "ckpt.pt")
    results = [r.value for r in spawn(meta_training_job, 2, str(tmp_path / "ckpt.pt"), timeout=300)]

    reference = source.build_model()
    reference.load_state_dict(checkpoint)
    data = [(source.example_inputs(BATCH)[0], source.example_targets(BATCH))] * STEPS
    losses = train_one_process(
        reference,
        torch.optim.SGD(reference.parameters(), lr=LR),
        data,
        MICROBATCHES,
        source.loss_fn,
    )
    expected = reference.state_dict()
    for r in results:
        assert r["meta"] == []
        torch.testing.assert_close(r["losses"], losses, rtol=1e-5, atol=1e-6)
        assert r["local"]  # each rank holds its stage only
        for key, value in r["local"].items():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6)
    assert set(results[0]["local"]) != set(results[1]["local"])
    assert set(results[0]["local"]) | set(results[1]["local"]) == set(expected)
