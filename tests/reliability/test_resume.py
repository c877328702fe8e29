"""Resuming and checkpoint directories: say what carries over and what changed, refuse what cannot continue,
write only over a run's own checkpoints, and find an unusable ``--checkpoint-dir`` before the first step.

One real checkpoint (2 ranks, 2 SGD steps, cosine schedule) is made once; each probe resumes a
copy of it as a user would (``fxpipe run``). A refusal is one line from the launching process,
before any worker starts (no ``[rank`` in it); the workers check the same again
(``check_resume`` under your own torchrun: the meta-less probe).
"""

from __future__ import annotations

import re

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from fxpipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
from fxpipe.errors import CheckpointError
from fxpipe.runtime.train.checkpoint import RECORD_NAME
from fxpipe.runtime.train.optim import lr_factor
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.train.run_record import RunRecord
from fxpipe.runtime.train.training_options import TrainingOptions

RUN = ["--timeout", "60"]


@pytest.fixture(scope="module")
def trained(mlp_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The checkpoint of 2 steps of the 2-stage MLP (SGD, lr 0.01, cosine over 2 steps)."""
    folder = tmp_path_factory.mktemp("trained")
    project = shutil.copytree(
        mlp_project, folder / "project", ignore=shutil.ignore_patterns("__pycache__")
    )
    assert (
        main(
            [
                "run",
                str(project / "build"),
                "--steps",
                "2",
                "--lr-schedule",
                "cosine",
                "--checkpoint-dir",
                str(folder / "ck"),
                *RUN,
            ]
        )
        == 0
    )  # on a copy: the session's build stays without a run.json
    return folder / "ck"


@pytest.fixture
def ck(trained: Path, tmp_path: Path) -> Path:
    """A private copy of the checkpoint."""
    return Path(shutil.copytree(trained, tmp_path / "ck"))


def _refused(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """``fxpipe run`` refused in one line, before any worker started."""
    assert main(argv) == 2
    captured = capsys.readouterr()
    err = captured.err
    assert (
        err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "[rank" not in err
    ), err
    assert "fxpipe run: " not in captured.out  # no worker printed its start line
    return err


def _files(folder: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_applies_a_new_lr_and_says_the_cosine_schedule_is_stretched(
    mlp_copy: Path, ck: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        main(
            [
                "run",
                str(mlp_copy),
                "--steps",
                "4",
                "--lr",
                "0.05",
                "--lr-schedule",
                "cosine",
                "--checkpoint-dir",
                str(ck),
                "--resume",
                *RUN,
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "resuming after step 2: the weights, the sgd state, the schedule's position" in out, out
    assert "changed since the checkpoint: lr 0.01 -> 0.05 (from step 3); steps 2 -> 4" in out, out
    assert (
        "the cosine schedule is stretched to end at step 4 (it ended at 2): step 3 gets lr 0.025"
        in out
    ), out
    record = RunRecord.from_json(mlp_copy / "run.json")
    want = [0.05 * lr_factor(s, warmup_steps=0, total_steps=4, schedule="cosine") for s in (2, 3)]
    assert record.lrs[2:] == pytest.approx(want)  # the new lr, on the stretched schedule
    assert record.lrs[:2] == pytest.approx([0.01, 0.005]) and record.first_step == 2


def test_resume_with_another_optimizer_is_refused_before_launch(
    mlp_copy: Path, ck: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        capsys,
        [
            "run",
            str(mlp_copy),
            "--steps",
            "4",
            "--optimizer",
            "adam",
            "--checkpoint-dir",
            str(ck),
            "--resume",
            *RUN,
        ],
    )
    assert "holds sgd's optimizer state, and this run asks for --optimizer adam" in err, err


def test_resume_of_a_finished_run_is_refused(
    mlp_copy: Path, ck: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        capsys,
        ["run", str(mlp_copy), "--steps", "2", "--checkpoint-dir", str(ck), "--resume", *RUN],
    )
    assert "is after step 2 and nothing is left to train; give --steps above 2" in err, err
    err = _refused(
        capsys,
        ["run", str(mlp_copy), "--steps", "1", "--checkpoint-dir", str(ck), "--resume", *RUN],
    )
    assert "--steps 1 is before it" in err, err


def test_resume_into_another_model_with_the_same_keys_is_refused(
    ck: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from probe_builds import make_build

    text = (ROOT / "examples" / "mlp.py").read_text()
    assert "nn.ReLU()" in text
    gelu = make_build(
        tmp_path / "gelu", text.replace("nn.ReLU()", "nn.GELU()")
    )  # the same state-dict keys
    err = _refused(
        capsys, ["run", str(gelu), "--steps", "4", "--checkpoint-dir", str(ck), "--resume", *RUN]
    )
    assert (
        "was saved from another model (stage 0's code differs)" in err and "fxpipe export" in err
    ), err


def test_a_new_run_does_not_write_over_a_checkpoint(
    mlp_copy: Path, ck: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = _files(ck)
    err = _refused(
        capsys, ["run", str(mlp_copy), "--steps", "4", "--checkpoint-dir", str(ck), *RUN]
    )
    assert "already holds a checkpoint (after step 2); continue it with --resume" in err, err
    assert _files(ck) == before


def test_parts_without_their_record_are_neither_resumed_nor_overwritten(
    mlp_copy: Path, ck: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (ck / RECORD_NAME).unlink()
    before = _files(ck)
    for resume in (["--resume"], []):
        err = _refused(
            capsys,
            ["run", str(mlp_copy), "--steps", "4", "--checkpoint-dir", str(ck), *resume, *RUN],
        )
        assert re.search(r"holds checkpoint parts \(dcp-[0-9a-f]+\) but no checkpoint.json", err), (
            err
        )
    assert _files(ck) == before


@pytest.mark.parametrize("how", ["a file", "below a file", "not writable"])
def test_an_unusable_checkpoint_dir_is_found_before_launch(
    how: str,
    mlp_copy: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import tempfile

    target = tmp_path / "ck"
    if how == "a file":
        target.write_text("not a folder")
    elif how == "below a file":
        (tmp_path / "f").write_text("")
        target = tmp_path / "f" / "ck"
    else:  # root writes anywhere: the probe's write fails as a read-only mount's would
        real = tempfile.mkstemp

        def mkstemp(*args: Any, **kwargs: Any) -> Any:
            if Path(kwargs.get("dir", "")) == target:
                raise PermissionError(13, "Permission denied")
            return real(*args, **kwargs)

        monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    err = _refused(
        capsys, ["run", str(mlp_copy), "--steps", "2", "--checkpoint-dir", str(target), *RUN]
    )
    fragment = {
        "a file": "is a file, not a directory",
        "below a file": "cannot be written",
        "not writable": "cannot be written (Permission denied)",
    }[how]
    assert fragment in err, err


def test_a_build_directory_that_cannot_take_run_json_is_found_before_launch(
    mlp_copy: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import tempfile

    real = tempfile.mkstemp

    def mkstemp(*args: Any, **kwargs: Any) -> Any:
        if Path(kwargs.get("dir", "")) == mlp_copy:
            raise OSError(30, "Read-only file system")
        return real(*args, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    err = _refused(capsys, ["run", str(mlp_copy), "--steps", "2", *RUN])
    assert "cannot be written (Read-only file system), so this run's record (run.json)" in err, err


def _old_fxpipe_resume_job(rank: int, world: int, build: str, ck: str) -> Any:
    from fxpipe.runtime.train.loop import train

    options = RunOptions(
        steps=4,
        timeout_s=60,
        training=TrainingOptions(optimizer="adam", checkpoint_dir=ck, resume=True),
    )
    return train(Path(build), options, Path(build) / f"run_{rank}.json")


def _old_fxpipe_save_job(rank: int, world: int, build: str, ck: str) -> None:
    """Two SGD steps saved in the per-rank format of an older fxpipe (no meta in the record)."""
    from fxpipe.modelfile import load_model_file
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.train.checkpoint import save_training_checkpoint, training_state
    from fxpipe.runtime.train.optim import optimizer_factory

    source = load_model_file(ROOT / "examples" / "mlp.py")
    sgd = optimizer_factory(TrainingOptions(optimizer="sgd"), 0.01)
    with PipelineRunner(build, source.loss_fn, timeout_s=60, optimizer_factory=sgd) as runner:
        batch = runner.manifest.batch_size
        x, y = source.example_inputs(batch), source.example_targets(batch)
        for _ in range(2):
            runner.step(x, y)
        state = training_state(runner, 2, 2, {"losses": [], "lrs": [], "grad_norms": []})
        save_training_checkpoint(ck, runner.rank, runner.world_size, state)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_checkpoint_without_meta_of_another_optimizer_is_refused_by_the_workers(
    mlp_copy: Path, tmp_path: Path
) -> None:
    """A checkpoint of an older fxpipe (per-rank parts, no meta in its record), resumed under your own
    torchrun: the optimizer's state is checked itself, before it fails inside the first step
    (KeyError: 'momentum')."""
    from spawn import spawn

    ck = tmp_path / "old"
    spawn(_old_fxpipe_save_job, 2, str(mlp_copy), str(ck), timeout=180)
    assert (
        "meta" not in json.loads((ck / RECORD_NAME).read_text())
        or not json.loads((ck / RECORD_NAME).read_text())["meta"]
    )
    results = spawn(
        _old_fxpipe_resume_job, 2, str(mlp_copy), str(ck), timeout=180, expect_failure=True
    )
    for r in results:
        assert (
            not r.ok
            and "CheckpointError" in r.error
            and "another optimizer than this run's Adam" in r.error
        ), r.error
    assert not any(mlp_copy.glob("run_*.json"))


# -- the comparison itself ---------------------------------------------------------------------------------------


IDENTITY = {
    "manifest_sha256": "m",
    "model_file": "model.py",
    "model_sha256": "a",
    "stage_sha256": ["s0", "s1"],
    "imports_model_file": [False, False],
}


def _meta(step: int = 2, **settings: Any) -> dict[str, Any]:
    from fxpipe.runtime.train.resume import run_settings

    options = RunOptions(steps=2, training=TrainingOptions(lr_schedule="cosine"))
    return {
        "version": 1,
        "step": step,
        "build": IDENTITY,
        "settings": {**run_settings(options, 4, 2), **settings},
    }


def _check(meta: dict[str, Any], identity: dict[str, Any] = IDENTITY, **training: Any) -> Any:
    from fxpipe.runtime.train.resume import check_resume

    steps = training.pop("steps", 4)
    lr = training.pop("lr", 0.01)
    options = RunOptions(
        steps=steps, lr=lr, training=TrainingOptions(**{"lr_schedule": "cosine", **training})
    )
    return check_resume(meta, None, options, 4, 2, identity, "ck")


def test_a_longer_resume_says_the_schedule_is_stretched_and_an_unchanged_one_says_nothing_changed() -> (
    None
):
    plan = _check(_meta(step=1))
    lr = 0.01 * lr_factor(1, warmup_steps=0, total_steps=4, schedule="cosine")
    stretched = (
        f"the cosine schedule is stretched to end at step 4 (it ended at 2): step 2 gets lr {lr:.3g}, "
        "where the checkpoint's schedule gave 0.005"
    )
    assert plan.changes == ("steps 2 -> 4", stretched)
    same = _check(_meta(step=1), steps=2)
    assert same.changes == () and len(same.lines()) == 1 and "carry over" in same.lines()[0]


def test_a_resume_to_keep_the_original_horizon_keeps_the_schedule() -> None:
    plan = _check(_meta(step=1), steps=2, lr=0.02)
    assert plan.changes == ("lr 0.01 -> 0.02 (from step 2)",)


def test_a_changed_model_file_is_refused_only_when_a_stage_runs_its_classes() -> None:
    other = {**IDENTITY, "model_sha256": "b"}
    assert "the model file (the stages' code is the same)" in _check(_meta(), other).changes
    with pytest.raises(CheckpointError, match="stage 1 runs classes from it"):
        _check(_meta(), {**other, "imports_model_file": [False, True]})
    with pytest.raises(CheckpointError, match="it has 2 stages, this build 3"):
        _check(_meta(), {**IDENTITY, "stage_sha256": ["s0", "s1", "s2"]})


def test_check_checkpoint_dir_creates_a_missing_one_and_reads_its_record(tmp_path: Path) -> None:
    from fxpipe.runtime.train.checkpoint import check_checkpoint_dir

    assert check_checkpoint_dir(tmp_path / "new" / "ck", resume=False) is None
    assert (tmp_path / "new" / "ck").is_dir() and not any((tmp_path / "new" / "ck").iterdir())
    assert (
        check_checkpoint_dir(tmp_path / "new" / "ck", resume=True) is None
    )  # nothing to resume yet: step 0


# -- --resume-from: another layout of the same model (Note [resuming into another layout]) ---------


@pytest.fixture(scope="module")
def one_stage(mlp_project: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model file partitioned into 1 stage (another layout of the checkpoint's model)."""
    from probe_builds import make_build

    return make_build(
        tmp_path_factory.mktemp("one") / "project", (mlp_project / "model.py").read_text(), 1
    )


@pytest.mark.slow
@pytest.mark.distributed
def test_resume_from_another_layout_says_the_layout_and_the_new_lr(
    one_stage: Path, ck: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_dir = tmp_path / "next"
    argv = ["run", str(one_stage), "--steps", "4", "--lr", "0.02", "--lr-schedule", "cosine"]
    argv += ["--resume-from", str(ck), "--checkpoint-dir", str(out_dir), *RUN]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "resuming after step 2: the weights, the sgd state, the schedule's position" in out, out
    assert (
        "layout 2 stages on 2 ranks x 1 replicas (1f1b) -> 1 stages on 1 ranks x 1 replicas" in out
    ), out
    assert "lr 0.01 -> 0.02 (from step 3)" in out, out
    assert "the RNG streams of the ranks holding stage 0 are not carried over" in out, out
    record = RunRecord.from_json(one_stage / "run.json")
    assert record.first_step == 2 and len(record.losses) == 4
    assert record.lrs[:2] == pytest.approx([0.01, 0.005])
    assert (out_dir / RECORD_NAME).is_file()  # its own checkpoints go to --checkpoint-dir


def test_resume_from_with_another_global_batch_is_refused_before_launch(
    one_stage: Path, ck: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        capsys,
        [
            "run",
            str(one_stage),
            "--steps",
            "4",
            "--batch-size",
            "8",
            "--resume-from",
            str(ck),
            *RUN,
        ],
    )
    assert "trained on 4 samples per step (batch 4 x 1 replicas), this run on 8" in err, err


def test_resume_from_with_another_optimizer_is_refused_before_launch(
    one_stage: Path, ck: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        capsys,
        ["run", str(one_stage), "--steps", "4", "--optimizer", "adam", "--resume-from", str(ck)]
        + RUN,
    )
    assert "--resume-from: the checkpoint in" in err and "--optimizer adam" in err, err


def test_resume_from_a_changed_model_file_into_another_layout_is_refused(
    ck: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from probe_builds import make_build

    text = (ROOT / "examples" / "mlp.py").read_text().replace("nn.ReLU()", "nn.GELU()")
    gelu = make_build(tmp_path / "gelu", text, 1)  # the same keys and shapes, another model
    err = _refused(capsys, ["run", str(gelu), "--steps", "4", "--resume-from", str(ck), *RUN])
    assert "was saved from another model" in err, err


def test_resume_from_names_what_it_cannot_read(
    one_stage: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _refused(
        capsys, ["run", str(one_stage), "--steps", "4", "--resume-from", str(tmp_path), *RUN]
    )
    assert "holds no checkpoint" in err, err
    err = _refused(
        capsys,
        ["run", str(one_stage), "--checkpoint-dir", str(tmp_path), "--resume"]
        + ["--resume-from", str(tmp_path), *RUN],
    )
    assert "--resume and --resume-from both name a checkpoint to continue; give one" in err, err


def test_partition_weights_from_a_run_checkpoint_and_export_it(
    mlp_project: Path, ck: Path, tmp_path: Path
) -> None:
    """``fxpipe partition --device meta --weights CKPT_DIR`` starts a build from a run's checkpoint,
    and ``fxpipe export`` writes the same state dict, in the model's own keys, without a job."""
    import torch
    from safetensors.torch import load_file

    from fxpipe.codegen import load_stage
    from fxpipe.runtime.train.dcp_checkpoint import read_model_state

    stored = read_model_state(ck)
    out = tmp_path / "from_ck"
    argv = ["partition", str(mlp_project / "model.py"), "--device", "meta", "--weights", str(ck)]
    assert main([*argv, "--stages", "1", "--batch-size", "4", "--out", str(out)]) == 0
    stage = load_stage(out, 0).state_dict()
    assert set(stage) == set(stored) and all(torch.equal(stage[k], stored[k]) for k in stage)
    assert main(["export", str(ck), "--out", str(tmp_path / "m.safetensors")]) == 0
    exported = load_file(tmp_path / "m.safetensors")
    assert set(exported) == set(stored) and all(torch.equal(exported[k], stored[k]) for k in stored)
