"""Training on batches whose sequence length changes every step, from one build (#36).

``varlen_lm.py`` declares its sequence dimension dynamic (``dynamic_dims()``); its ``train_batches``
yields another length every step (8, 12, 5, 16, 9, 24, ...), and the rank of the last stage yields
no inputs (it learns the step's length from the batch check's all-gather, Note [shape formulas]).
``fxpipe run``'s loop on 2 ranks (gloo) trains equal to one process on the same batches, fp32, for
GPipe, 1F1B and ZBV, with the embedding tied to the head.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from builds import original_model
from fxpipe.codegen import Manifest, write_build_dir
from fxpipe.errors import FxpipeError
from fxpipe.modelfile import load_model_file
from fxpipe.partitioner import plan_partition
from fxpipe.runtime.train.data_iter import RankInfo
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.tracer import trace_model_file
from spawn import spawn

MODEL = Path(__file__).with_name("varlen_lm.py")
LLAMA = Path(__file__).with_name("varlen_llama.py")
BATCH, MICROBATCHES, STEPS, LR = 4, 2, 6, 0.05


def _build(out: Path, schedule: str, model: Path = MODEL) -> Path:
    source = load_model_file(model)
    traced = trace_model_file(source, BATCH // MICROBATCHES, progress=False)
    plan = plan_partition(traced.profile, 2, microbatches=MICROBATCHES, schedule=schedule)
    write_build_dir(traced, plan, out, source, batch_size=BATCH, microbatches=MICROBATCHES)
    return out


def _train_job(rank: int, world: int, build: str, schedule: str, steps: int = STEPS) -> Any:
    import fxpipe.runtime.train.loop as training

    options = RunOptions(steps=steps, lr=LR, timeout_s=60, schedule=schedule)
    return training.train(Path(build), options, Path(build) / f"run_{rank}.json")


def _reference(
    build: Path, model_file: Path = MODEL, steps: int = STEPS
) -> tuple[list[float], dict[str, torch.Tensor]]:
    source = load_model_file(model_file)
    model = original_model(build, source, Manifest.from_json(build).num_stages).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    stream = source.module.train_batches(BATCH, RankInfo(0, 1, 0, 1, 0, 1, True, True))
    losses = []
    for _ in range(steps):
        x, y = next(stream)
        opt.zero_grad()
        total = 0.0
        for k in range(MICROBATCHES):
            if isinstance(x, dict):  # the model's own loss (labels=)
                loss = model(**{n: t.chunk(MICROBATCHES)[k] for n, t in x.items()}).loss
            else:
                loss = source.loss_fn(model(x.chunk(MICROBATCHES)[k]), y.chunk(MICROBATCHES)[k])
            (loss / MICROBATCHES).backward()
            total += loss.item()
        opt.step()
        losses.append(total / MICROBATCHES)
    return losses, model.state_dict()


@pytest.mark.distributed
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zbv"])
def test_every_step_another_length_trains_like_one_process(tmp_path: Path, schedule: str) -> None:
    build = _build(tmp_path / "build", "zbv" if schedule == "zbv" else "1f1b")
    manifest = Manifest.from_json(build)
    assert [r.name for r in manifest.dynamic] == ["seq"] and manifest.dynamic[0].max == 24
    record = spawn(_train_job, 2, str(build), schedule, timeout=240)[0].value
    want, _ = _reference(build)
    assert len(record.losses) == STEPS
    torch.testing.assert_close(
        torch.tensor(record.losses), torch.tensor(want), rtol=1e-5, atol=1e-6
    )


@pytest.mark.distributed
def test_a_transformers_llama_with_labels_trains_on_varying_lengths_like_one_process(
    tmp_path: Path,
) -> None:
    """Its own loss (``labels=``), tied embeddings, lengths 8, 16, 5, 12: the causal mask, the
    positions and the rotary tables follow each step's length."""
    build = _build(tmp_path / "build", "1f1b", LLAMA)
    record = spawn(_train_job, 2, str(build), "1f1b", 4, timeout=240)[0].value
    want, _ = _reference(build, LLAMA, 4)
    torch.testing.assert_close(
        torch.tensor(record.losses), torch.tensor(want), rtol=1e-5, atol=1e-6
    )


def test_a_length_outside_the_range_is_refused_before_any_message(tmp_path: Path) -> None:
    build = _build(tmp_path / "build", "1f1b")
    manifest = Manifest.from_json(build)
    with pytest.raises(FxpipeError, match=r"seq = 30 is outside the range 2\.\.24"):
        manifest.step_sizes([(4, 30)])
    assert manifest.step_sizes([(4, 7)]) == {"seq": 7}


def _train_job_tp(rank: int, world: int, build: str, steps: int) -> Any:
    import fxpipe.runtime.train.loop as training

    options = RunOptions(steps=steps, lr=LR, timeout_s=120, schedule="1f1b", tp=2)
    return training.train(Path(build), options, Path(build) / f"run_{rank}.json")


@pytest.mark.distributed
def test_tensor_parallel_stages_train_on_varying_lengths_like_one_process(tmp_path: Path) -> None:
    """2 stages x tp 2 (4 processes) of the transformers Llama: heads split, lengths free (#40
    with #36): lengths 8, 16, 5, 12 equal one process."""
    from fxpipe.codegen.tp_plan import read_tp_plan

    build = _build(tmp_path / "build", "1f1b", LLAMA)
    plan = read_tp_plan(build)
    assert all(plan.stage(s).for_degree(2).styles for s in (0, 1))  # both stages split
    records = [r.value for r in spawn(_train_job_tp, 4, str(build), 4, timeout=400)]
    want, _ = _reference(build, LLAMA, 4)
    torch.testing.assert_close(
        torch.tensor(records[0].losses), torch.tensor(want), rtol=1e-5, atol=1e-6
    )
