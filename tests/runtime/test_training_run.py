"""The worker's training loop on real data: batches from the model file, checkpoints, resume, export.

``examples/charlm.py`` (a character LM on README.md, with ``train_batches`` / ``eval_batches``)
trains on 2 ranks with AdamW + warm-up + cosine + clipping through ``fxpipe.runtime.train.loop.train``:
its losses equal one process training the whole model on the same batches; a run that crashes
after a checkpoint and is resumed gives bit-for-bit the losses and weights of an uninterrupted
run; ``fxpipe export`` gathers the stages into the original state dict. A checkpoint whose save
is cut off leaves the previous one loadable.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from builds import EXAMPLES, make_build, original_model
from fxpipe.cli import main
from fxpipe.errors import CheckpointError
from fxpipe.modelfile import load_model_file
from fxpipe.runtime.train.data_iter import RankInfo
from fxpipe.runtime.train.optim import optimizer_factory, scheduler_factory
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.train.dcp_checkpoint import read_tensors
from fxpipe.runtime.train.checkpoint import (
    checkpoint_meta,
    gather_state_dict,
    load_training_checkpoint,
    part_path,
    save_training_checkpoint,
)
from fxpipe.runtime.train.training_options import TrainingOptions
from spawn import spawn

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
STAGES, BATCH, MICROBATCHES, STEPS = 2, 8, 2, 6
TRAINING = TrainingOptions(
    optimizer="adamw",
    warmup_steps=2,
    lr_schedule="cosine",
    clip_grad_norm=0.5,
    eval_every=3,
    eval_steps=2,
    log_every=2,
)
OPTIONS = RunOptions(steps=STEPS, lr=3e-3, timeout_s=60, training=TRAINING)


@pytest.fixture(scope="module")
def charlm_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_build(
        "charlm", tmp_path_factory.mktemp("charlm") / "build", STAGES, BATCH, MICROBATCHES
    )


def _train_job(rank: int, world: int, build: str, options: RunOptions, crash_at: int | None) -> Any:
    """``train`` on this rank; with ``crash_at`` the data stream fails when batch ``crash_at`` is drawn."""
    import fxpipe.runtime.train.loop as training

    if crash_at is not None:
        real = training.batch_stream

        def crashing(*args: Any, **kwargs: Any) -> Any:
            position = kwargs.get("start", 0)
            for item in real(*args, **kwargs):
                if position == crash_at:
                    raise RuntimeError("simulated crash")
                position += 1
                yield item

        training.batch_stream = crashing  # type: ignore[assignment]
    return training.train(Path(build), options, Path(build) / f"run_{rank}.json")


def _reference(build: Path) -> tuple[list[float], dict[str, torch.Tensor], list[float]]:
    """One process, the whole model, replica 0's batches: losses, final state, eval losses."""
    source = load_model_file(EXAMPLES / "charlm.py")
    model = original_model(build, source, STAGES).train()
    opt = optimizer_factory(TRAINING, OPTIONS.lr)(list(model.parameters()))
    sched = scheduler_factory(TRAINING, STEPS)(opt)
    info = RankInfo(0, 1, 0, 1, 0, 1, True, True)
    stream = source.module.train_batches(BATCH, info)
    losses, evals = [], []
    for k in range(STEPS):
        x, y = next(stream)
        opt.zero_grad()
        total = 0.0
        for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES)):
            loss = source.loss_fn(model(xm), ym)
            (loss / MICROBATCHES).backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), TRAINING.clip_grad_norm)
        opt.step()
        sched.step()
        losses.append(total / MICROBATCHES)
        if (k + 1) % 3 == 0:
            model.eval()
            with torch.no_grad():
                held = source.module.eval_batches(BATCH, info)
                val = [
                    source.loss_fn(model(xm), ym).item()
                    for x, y in (next(held), next(held))
                    for xm, ym in zip(x.chunk(MICROBATCHES), y.chunk(MICROBATCHES))
                ]
            evals.append(sum(val) / len(val))
            model.train()
    return losses, model.state_dict(), evals


@pytest.mark.distributed
@pytest.mark.slow
def test_train_batches_crash_resume_bit_for_bit_and_export(
    charlm_build: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    straight = replace(OPTIONS, training=replace(TRAINING, checkpoint_dir=str(tmp_path / "a")))
    record = spawn(_train_job, STAGES, str(charlm_build), straight, None, timeout=240)[0].value

    want_losses, want_state, want_evals = _reference(charlm_build)
    torch.testing.assert_close(torch.tensor(record.losses), torch.tensor(want_losses))
    torch.testing.assert_close(
        torch.tensor([v for _, v in record.eval_losses]), torch.tensor(want_evals)
    )
    assert [s for s, _ in record.eval_losses] == [3, 6] and len(record.grad_norms) == STEPS
    assert record.losses[-1] < record.losses[0]

    # crash while drawing batch 4 (0-based), after the checkpoint of step 3; then resume
    interrupted = replace(
        OPTIONS, training=replace(TRAINING, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=3)
    )
    failed = spawn(
        _train_job, STAGES, str(charlm_build), interrupted, 4, timeout=240, expect_failure=True
    )
    assert all(not r.ok and "simulated crash" in r.error for r in failed)
    assert checkpoint_meta(tmp_path / "b")["step"] == 3
    resumed = spawn(
        _train_job,
        STAGES,
        str(charlm_build),
        replace(interrupted, training=replace(interrupted.training, resume=True)),
        None,
        timeout=240,
    )[0].value
    assert resumed.first_step == 3 and len(resumed.step_seconds) == STEPS - 3
    assert list(resumed.losses) == list(record.losses)  # bit for bit, the first three carried over
    assert resumed.eval_losses == record.eval_losses
    a, b = gather_state_dict(tmp_path / "a"), gather_state_dict(tmp_path / "b")
    assert set(a) == set(b)
    assert all(torch.equal(a[k], b[k]) for k in a)

    # export: the original model's keys, loadable by build_model().load_state_dict
    out = tmp_path / "model.safetensors"
    assert main(["export", str(tmp_path / "a"), "--out", str(out)]) == 0
    from safetensors.torch import load_file

    model = load_model_file(EXAMPLES / "charlm.py").build_model()
    model.load_state_dict(load_file(out))  # strict: every key of the original model
    for key, value in model.state_dict().items():
        assert torch.equal(value, a[key]), key
        if not key.endswith(
            "qkv.bias"
        ):  # the key bias: Adam normalises round-off (see test_training_optim)
            torch.testing.assert_close(value, want_state[key], msg=key, rtol=1e-4, atol=1e-5)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("shard", ["grad-op", "full"])
def test_sharded_replicas_resume_bit_for_bit(
    charlm_build: Path, tmp_path: Path, shard: str
) -> None:
    from fxpipe.runtime.dataparallel import DataParallelOptions

    steps, world = (
        4,
        2 * STAGES,
    )  # 2 stages x 2 replicas, each stage's state sharded over its 2 replicas
    base = replace(
        OPTIONS,
        steps=steps,
        dp=2,
        data_parallel=DataParallelOptions(shard=shard),
        training=replace(TRAINING, eval_every=None, clip_grad_norm=None),
    )  # clipping: not with FSDP yet
    straight = replace(base, training=replace(base.training, checkpoint_dir=str(tmp_path / "a")))
    record = spawn(_train_job, world, str(charlm_build), straight, None, timeout=300)[0].value
    interrupted = replace(
        base,
        training=replace(base.training, checkpoint_dir=str(tmp_path / "b"), checkpoint_every=2),
    )
    failed = spawn(
        _train_job, world, str(charlm_build), interrupted, 2, timeout=300, expect_failure=True
    )
    assert all(not r.ok and "simulated crash" in r.error for r in failed)
    resumed = spawn(
        _train_job,
        world,
        str(charlm_build),
        replace(interrupted, training=replace(interrupted.training, resume=True)),
        None,
        timeout=300,
    )[0].value
    assert resumed.first_step == 2 and list(resumed.losses) == list(record.losses)  # bit for bit
    assert record.losses[-1] < record.losses[0]
    for prefix in ("model.", "optim."):  # every tensor, whole, identical after both runs
        a, b = read_tensors(tmp_path / "a", prefix), read_tensors(tmp_path / "b", prefix)
        assert a and set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    whole = load_model_file(EXAMPLES / "charlm.py").build_model().state_dict()
    model = read_tensors(tmp_path / "a", "model.")
    assert {k: v.shape for k, v in model.items()} == {
        k: whole[k].shape for k in model
    }  # the model's own shapes, whatever the sharding
    assert all(f"{k}.exp_avg" in read_tensors(tmp_path / "a", "optim.") for k in model if "." in k)


def _state(value: float) -> dict[str, Any]:
    return {
        "step": int(value),
        "model": {"w": torch.full((3,), value)},
        "history": {"losses": [value]},
    }


def test_a_save_cut_off_leaves_the_previous_checkpoint_loadable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import fxpipe.runtime.train.checkpoint as ckpt

    save_training_checkpoint(tmp_path, 0, 1, _state(1.0))
    assert load_training_checkpoint(tmp_path, 0, 1)["step"] == 1

    def no_record(*args: Any) -> None:  # killed before the commit point
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ckpt, "write_record", no_record)
    with pytest.raises(CheckpointError, match="No space left on device; the previous checkpoint"):
        save_training_checkpoint(tmp_path, 0, 1, _state(2.0))
    monkeypatch.undo()
    got = load_training_checkpoint(tmp_path, 0, 1)
    assert got["step"] == 1 and torch.equal(got["model"]["w"], torch.full((3,), 1.0))

    def no_rename(
        *args: Any,
    ) -> None:  # killed after the commit, before the rename: the load finishes it
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpt, "publish", no_rename)
    with pytest.raises(KeyboardInterrupt):
        save_training_checkpoint(tmp_path, 0, 1, _state(3.0))
    monkeypatch.undo()
    assert load_training_checkpoint(tmp_path, 0, 1)["step"] == 3

    part_path(tmp_path, 0).write_bytes(b"flipped")
    with pytest.raises(CheckpointError, match="does not match its checkpoint record"):
        load_training_checkpoint(tmp_path, 0, 1)
    with pytest.raises(CheckpointError, match="was saved by 1 ranks, this run has 2"):
        load_training_checkpoint(tmp_path, 0, 2)


def test_fxpipe_run_checks_the_data_before_launch(
    charlm_build: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n"
        "def rows(batch_size, rank_info):\n"
        "    while True:\n"
        "        yield torch.zeros(batch_size + 1, 32, dtype=torch.long), None\n"
        "def few_targets(batch_size, rank_info):\n"
        "    while True:\n"
        "        x = torch.zeros(batch_size, 32, dtype=torch.long)\n"
        "        yield x, torch.zeros(2, 32, dtype=torch.long)\n"
    )
    cases = {
        f"{bad}:rows": "yielded input 'idx' with 9 rows along its batch dim 0; yield one replica's batch of 8",
        f"{bad}:few_targets": r"yielded targets of shape \(2, 32\): 2 along the batch dim 0, not 8",
        f"{bad}:nope": "bad.py defines no function nope",
        f"{tmp_path}/missing.py:fn": "data file .* does not exist",
    }
    for spec, message in cases.items():
        assert main(["run", str(charlm_build), "--steps", "1", "--data", spec]) == 2
        captured = capsys.readouterr()
        out = captured.out + captured.err
        assert re.search(message, out), out
        assert (
            out.count("\n") == 1 and "[rank" not in out
        )  # one line, from this process, before any worker
    assert main(["run", str(charlm_build), "--steps", "1", "--microbatches", "3"]) != 0
    assert "does not split into 3 equal microbatches" in "".join(capsys.readouterr())


def test_a_rank_that_reads_no_model_input_gets_free_placeholders(charlm_build: Path) -> None:
    from fxpipe.codegen.manifest import Manifest
    from fxpipe.runtime.train.data_iter import batch_stream, rank_needs_inputs

    manifest = Manifest.from_json(charlm_build)
    assert rank_needs_inputs(manifest, [0]) and not rank_needs_inputs(manifest, [1])
    source = load_model_file(EXAMPLES / "charlm.py")
    info = RankInfo(1, 2, 1, 2, 0, 1, needs_inputs=False, needs_targets=True)
    (idx,), targets = next(batch_stream(source.module.train_batches, manifest, BATCH, info))
    assert idx.shape == (BATCH, 32) and idx.stride() == (0, 0)  # no memory behind it
    first = next(
        batch_stream(source.module.train_batches, manifest, BATCH, replace(info, needs_inputs=True))
    )
    assert torch.equal(first[1], targets)  # the same stream whatever the rank reads
    third = next(batch_stream(source.module.train_batches, manifest, BATCH, info, start=2))
    stream = batch_stream(source.module.train_batches, manifest, BATCH, info)
    next(stream), next(stream)
    assert torch.equal(next(stream)[1], third[1])  # a resumed stream skips to its position


@pytest.mark.distributed
@pytest.mark.slow
def test_fxpipe_run_logs_evaluates_and_records_through_torchrun(
    charlm_build: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "run",
                str(charlm_build),
                "--steps",
                "4",
                "--optimizer",
                "adam",
                "--lr",
                "1e-2",
                "--warmup-steps",
                "2",
                "--lr-schedule",
                "linear",
                "--clip-grad-norm",
                "1",
                "--eval-every",
                "2",
                "--log-every",
                "2",
                "--precision",
                "bf16",
                "--timeout",
                "60",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "adam lr 0.01 (linear, 2 warm-up steps), bf16 autocast" in out
    assert re.search(
        r"step +2/4 +loss \d+\.\d+ +lr 1\.00e-02 +grad norm \d+\.\d+ +\d+\.\d samples/s .* ETA 0:00:0\d",
        out,
    ), out
    assert out.count("eval after step") == 2
    from fxpipe.runtime.train.run_record import RunRecord

    record = RunRecord.from_json(charlm_build / "run.json")
    assert record.lrs == pytest.approx((5e-3, 1e-2, 1e-2, 5e-3)) and len(record.grad_norms) == 4
    assert [s for s, _ in record.eval_losses] == [2, 4] and record.precision == "bf16"
    assert record.optimizer == "adam" and record.first_step == 0
