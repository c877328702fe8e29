"""Hugging Face models as training loops call them (issue 10, items 6 and 7), end to end.

``examples/hf_lm.py``: unwrapped GPT-2 and BART (their ``ModelOutput`` out), keyword inputs with
``labels=`` and no ``loss_fn``, so training uses the model's own ``output.loss``. Each is
partitioned and verified through the command line and trained on 2 ranks, equal to one process
on the same microbatches (losses and every parameter, fp32).
"""

from __future__ import annotations

import re

from pathlib import Path
from typing import Any

import pytest
import torch

from example_models import HF_LM
from fxpipe.cli import main
from fxpipe.errors import RuntimeSetupError
from fxpipe.modelfile import ModelSource, load_model_file
from fxpipe.runtime.launch.launcher import run_build
from fxpipe.runtime.pipeline.loss import model_loss
from fxpipe.runtime.train.run_options import RunOptions
from spawn import spawn

EXAMPLE = HF_LM
MODELS = {"gpt2": ("build_model", "example_inputs"), "bart": ("build_bart", "bart_inputs")}
BATCH, MICROBATCHES, STEPS, LR = 4, 2, 2, 0.5


def _source(name: str) -> ModelSource:
    model_fn, inputs_fn = MODELS[name]
    return load_model_file(EXAMPLE, model_fn=model_fn, inputs_fn=inputs_fn)


def _partition_and_verify(name: str, out: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    model_fn, inputs_fn = MODELS[name]
    assert (
        main(
            [
                "partition",
                f"{EXAMPLE}:{model_fn}",
                "--inputs-fn",
                inputs_fn,
                "--stages",
                "2",
                "--batch-size",
                str(BATCH),
                "--microbatches",
                str(MICROBATCHES),
                "--solver",
                "params",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert main(["verify", str(out)]) == 0
    out_text = capsys.readouterr().out
    assert "OK: the stages equal the model in train and eval mode" in out_text
    for mode in ("train", "eval"):  # the chained stages compute the very same outputs
        assert re.search(rf"{mode} mode OK: \d+ outputs max abs 0;", out_text), out_text
    return out


def _reference(source: ModelSource) -> tuple[list[float], dict[str, torch.Tensor], list[set[str]]]:
    """One process: SGD, each step the mean of the microbatches' own losses; the losses, the final
    state and the names of each tied parameter."""
    model = source.build_model().train()
    names: dict[int, set[str]] = {}
    for key, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), set()).add(key)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    batch = source.example_call(BATCH).kwargs
    chunks = [{k: v.chunk(MICROBATCHES)[m] for k, v in batch.items()} for m in range(MICROBATCHES)]
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        step = [model(**chunk).loss for chunk in chunks]
        (sum(step) / MICROBATCHES).backward()
        opt.step()
        losses.append(sum(float(v.detach()) for v in step) / MICROBATCHES)
    return (
        losses,
        {k: v.detach().clone() for k, v in model.state_dict().items()},
        list(names.values()),
    )


def _runner_job(rank: int, world: int, build: str, name: str) -> dict[str, Any]:
    """``PipelineRunner(build, loss_fn=None)`` fed the model file's keyword call."""
    from fxpipe.runtime import PipelineRunner

    source = _source(name)
    batch = source.example_call(BATCH)
    with PipelineRunner(
        build,
        None,
        microbatches=MICROBATCHES,
        timeout_s=60,
        optimizer_factory=lambda p: torch.optim.SGD(p, lr=LR),
    ) as runner:
        losses = [runner.step(batch) for _ in range(STEPS)]
        return {
            "losses": losses,
            "state": {k: v.detach().clone() for k, v in runner.stage.state_dict().items()},
        }


def _assert_trains_like_one_process(build: Path, name: str) -> list[float]:
    """PipelineRunner on 2 ranks against one process: losses and every parameter; the losses."""
    want_losses, want_state, tied = _reference(_source(name))
    results = [r.value for r in spawn(_runner_job, 2, str(build), name, timeout=240)]
    for r in results:
        torch.testing.assert_close(torch.tensor(r["losses"]), torch.tensor(want_losses))
    state = {**results[0]["state"], **results[1]["state"]}
    assert set(state) <= set(want_state)
    assert all(
        keys & set(state) for keys in tied
    )  # every parameter, under one of its tied names at least
    for key, value in state.items():
        torch.testing.assert_close(value, want_state[key], msg=key)
    assert want_losses[-1] < want_losses[0]
    return want_losses


@pytest.mark.distributed
@pytest.mark.slow
def test_gpt2_keyword_call_with_labels_partitions_verifies_and_trains_on_its_own_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build = _partition_and_verify("gpt2", tmp_path / "gpt2", capsys)
    from fxpipe.codegen import read_manifest

    manifest = read_manifest(build)
    assert [t.name for t in manifest.inputs] == ["input_ids", "attention_mask", "labels"]
    assert manifest.output_modules == ("transformers.modeling_outputs",)
    want_losses = _assert_trains_like_one_process(build, "gpt2")
    # `fxpipe run`: a model file without loss_fn or example_targets trains on output.loss
    result = run_build(
        build, RunOptions(steps=STEPS, microbatches=MICROBATCHES, lr=LR, timeout_s=60), quiet=True
    )
    torch.testing.assert_close(torch.tensor(result.losses), torch.tensor(want_losses))


@pytest.mark.distributed
@pytest.mark.slow
def test_bart_keyword_call_with_labels_partitions_verifies_and_trains_on_its_own_loss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build = _partition_and_verify("bart", tmp_path / "bart", capsys)
    _assert_trains_like_one_process(build, "bart")


def test_model_loss_reads_the_output_and_says_what_is_missing() -> None:
    loss = torch.tensor(1.5)
    assert model_loss({"loss": loss, "logits": torch.zeros(2)}) is loss
    assert model_loss(type("Out", (), {"loss": loss})()) is loss
    with pytest.raises(
        RuntimeSetupError, match=r"output \(Tensor\) holds no loss tensor; pass the model labels="
    ):
        model_loss(torch.zeros(2))
    with pytest.raises(RuntimeSetupError, match="holds no loss tensor"):
        model_loss({"logits": torch.zeros(2), "loss": None})


def test_a_model_file_without_loss_fn_needs_no_targets(tmp_path: Path) -> None:
    from fxpipe.codegen import read_manifest
    from fxpipe.runtime.train.data import example_batch, model_source

    build = tmp_path / "b"
    assert (
        main(
            [
                "partition",
                f"{EXAMPLE}",
                "--stages",
                "2",
                "--batch-size",
                "4",
                "--microbatches",
                "2",
                "--out",
                str(build),
            ]
        )
        == 0
    )
    manifest = read_manifest(build)
    source = model_source(build, manifest)
    inputs, targets = example_batch(source, manifest, 4)
    assert targets is None and [t.shape for t in inputs] == [(4, 12)] * 3
    assert inputs[2].equal(inputs[0])  # the labels are the ids: the model shifts them itself
