"""The seed API on a model built on meta, loaded from a checkpoint by ``smp.load`` (full or partial) or by the
config's ``weights``: each rank materialises only its stage, and training equals one process that loaded the
same checkpoint."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from meta_checkpoint_scenarios import meta_checkpoint_job
from meta_scenarios import BATCH, GPT, LR, MICROBATCHES, STEPS
from oracle import train_one_process
from safetensors.torch import save_file
from spawn import spawn

from fxpipe.errors import ConfigError
from fxpipe.modelfile import load_model_file
from fxpipe.smp.config import Config


def _start() -> dict[str, torch.Tensor]:
    torch.manual_seed(11)
    return load_model_file(GPT).build_model().state_dict()


def _reference(state: dict[str, torch.Tensor]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process that loaded ``state``, trained as the jobs train: its losses and final state dict."""
    source = load_model_file(GPT)
    reference = source.build_model()
    reference.load_state_dict(state)
    data = [(source.example_inputs(BATCH)[0], source.example_targets(BATCH))] * STEPS
    losses = train_one_process(
        reference,
        torch.optim.SGD(reference.parameters(), lr=LR),
        data,
        MICROBATCHES,
        source.loss_fn,
    )
    return losses, reference.state_dict()


def _assert_trains_like(results: list[dict[str, Any]], state: dict[str, torch.Tensor]) -> None:
    losses, expected = _reference(state)
    for r in results:
        assert r["meta"] == []
        torch.testing.assert_close(r["losses"], losses, rtol=1e-5, atol=1e-6)
        assert r["local"]
        for key, value in r["local"].items():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6)
    assert set(results[0]["local"]) != set(results[1]["local"])  # each rank holds its stage only
    assert set(results[0]["local"]) | set(results[1]["local"]) == set(expected)


def _run(mode: str, checkpoint: Path, save_to: Path | None = None) -> list[dict[str, Any]]:
    return [
        r.value
        for r in spawn(
            meta_checkpoint_job,
            2,
            mode,
            str(checkpoint),
            None if save_to is None else str(save_to),
            timeout=300,
        )
    ]


@pytest.mark.slow
def test_smp_load_full_then_partial(tmp_path):
    state = _start()
    torch.save(state, tmp_path / "start.pt")
    first = _run("full", tmp_path / "start.pt", save_to=tmp_path / "trained.pt")
    _assert_trains_like(first, state)
    trained = first[0]["full"]
    assert all(torch.equal(trained[k], first[1]["full"][k]) for k in trained)
    again = _run("partial", tmp_path / "trained.pt")  # the parts smp.save wrote, one per stage
    _assert_trains_like(again, trained)


@pytest.mark.slow
def test_config_weights_from_a_safetensors_file(tmp_path):
    state, seen = {}, set()
    for key, t in _start().items():  # each tied tensor once, as transformers saves them
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            state[key] = t.clone().contiguous()
    assert len(state) < len(_start())  # the tied head is read under the embedding's key
    save_file(state, str(tmp_path / "model.safetensors"))
    _assert_trains_like(_run("config", tmp_path / "model.safetensors"), _start())


def test_config_weights_must_exist(tmp_path):
    with pytest.raises(
        ConfigError, match=r"config 'weights' must be a checkpoint file or directory"
    ):
        Config.from_dict({"partitions": 2, "weights": str(tmp_path / "nope.safetensors")})
    assert Config.from_dict({"partitions": 2, "weights": tmp_path}).weights == str(tmp_path)


@pytest.mark.slow
def test_smp_load_of_a_full_checkpoint_into_another_partition_count(tmp_path):
    """A full checkpoint saved by 2 partitions loads into 1, and one saved by 1 into 2: each then
    trains like one process that loaded the same state."""
    from meta_checkpoint_scenarios import repartition_job

    state = _start()
    torch.save(state, tmp_path / "start.pt")
    full = str(tmp_path / "full.pt")
    two = [
        r.value for r in spawn(repartition_job, 2, str(tmp_path / "start.pt"), full, timeout=300)
    ]
    _assert_trains_like(two, state)
    (one,) = [r.value for r in spawn(repartition_job, 1, "", f"{full}.next", timeout=300)]
    losses, expected = _reference(two[0]["full"])
    torch.testing.assert_close(one["losses"], losses, rtol=1e-5, atol=1e-6)
    assert set(one["local"]) == set(expected)  # one partition holds the whole model
    for key, value in one["local"].items():
        torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6)
    again = [r.value for r in spawn(repartition_job, 2, "", f"{full}.next.next", timeout=300)]
    _assert_trains_like(again, one["full"])
