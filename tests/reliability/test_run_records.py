"""What a run leaves behind can be trusted: a record of the build it ran, a run that diverges stopped and
recorded, and a full disk named as the user's disk.

- A build directory re-partitioned while a run trains gets no record of the old run (it goes
  beside it, and the run says where); ``fxpipe report`` never sets a run beside another plan.
- A NaN loss stops the run at that step on every rank, with one line naming the step and the
  stage; ``run.json`` is written (marked stopped) and the last checkpoint is the one before.
  Under fp16 the loss scaler skips such a step and the run goes on.
- A full disk while emitting a build or writing a log is a one-line ``OSError`` message, never
  "internal error", and a full log disk does not stop training.
"""

from __future__ import annotations

import errno
import hashlib
import io
import os
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest

from fxpipe.cli import main

ROOT = Path(__file__).resolve().parents[2]
from fxpipe.runtime.train.run_record import RunRecord

# A small MLP whose loss is NaN at the steps FXPIPE_PROBE_NAN_STEPS names (2 microbatches a step).
NAN_MODEL = """
import os
import torch
import torch.nn as nn
import torch.nn.functional as F

CALLS = [0]


def build_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def example_inputs(b):
    return (torch.randn(b, 8, generator=torch.Generator().manual_seed(1)),)


def example_targets(b):
    return torch.randint(0, 4, (b,), generator=torch.Generator().manual_seed(2))


def loss_fn(out, target):
    CALLS[0] += 1
    loss = F.cross_entropy(out, target)
    step = (CALLS[0] - 1) // 2 + 1
    if str(step) in os.environ.get("FXPIPE_PROBE_NAN_STEPS", "").split(","):
        return loss * float("nan")
    return loss
"""


@pytest.fixture(scope="module")
def nan_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from probe_builds import make_build

    return make_build(tmp_path_factory.mktemp("nan") / "project", NAN_MODEL)


def _one_error(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# -- a record names its build ------------------------------------------------------------------------------------


def _build3(project: Path) -> Path:
    """A 3-stage build of the project's model, beside its 2-stage ``build``."""
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    source = load_model_file(project / "model.py")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = trace_model_file(source, 2, progress=False)
    plan = plan_partition(traced.profile, 3, microbatches=2)
    write_build_dir(traced, plan, project / "build3", source, batch_size=4, microbatches=2)
    return project / "build3"


@pytest.mark.slow
@pytest.mark.distributed
def test_a_run_does_not_write_its_record_into_a_build_replaced_while_it_ran(
    leaf_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from procs import FaultyRun

    new = _build3(leaf_copy.parent)
    ran = hashlib.sha256((leaf_copy / "manifest.json").read_bytes()).hexdigest()
    run = FaultyRun(leaf_copy, steps=30, timeout_s=60, env={"FXPIPE_PROBE_LOSS": "slow"})
    run.wait_for_step(1)
    os.rename(
        leaf_copy, leaf_copy.with_name("old")
    )  # `fxpipe partition --out build` swaps a build in so
    os.rename(new, leaf_copy)
    assert run.proc.wait(180) == 2
    line = _one_error(run.error_text)
    assert (
        "was replaced while this run trained" in line
        and "this run's record was not written into it" in line
    ), line
    assert not (
        leaf_copy / "run.json"
    ).exists()  # the 3-stage build holds no record of a 2-stage run
    aside = list(leaf_copy.parent.glob("build.run-*.json"))
    assert len(aside) == 1 and str(aside[0]) in line
    record = RunRecord.from_json(aside[0])
    assert record.build_sha256 == ran and record.num_stages == 2 and len(record.losses) == 30
    assert main(["report", str(leaf_copy)]) == 0
    assert "prediction vs measured" not in capsys.readouterr().out


def test_report_never_sets_a_run_beside_another_builds_plan(
    mlp_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    record = RunRecord(
        losses=(1.0,),
        step_seconds=(0.01,),
        median_step_ms=10.0,
        samples_per_second=400.0,
        schedule="1f1b",
        microbatches=2,
        batch_size=4,
        lr=0.01,
        world_size=2,
        num_stages=2,
        device="cpu",
        backend="gloo",
        predicted_step_ms=2.0,
        peak_memory_bytes=(1, 1),
        peak_tensor_bytes=(1, 1),
        dp=1,
        global_batch_size=4,
        comm_hook="none",
        powersgd_rank=1,
        shard_optimizer_state=False,
        backward_passes_per_step=1,
    )
    record.to_json(mlp_copy / "run.json")
    assert (
        main(["report", str(mlp_copy)]) == 0
    )  # a record of an older fxpipe, of the same stages: compared
    assert "prediction vs measured" in capsys.readouterr().out
    from dataclasses import replace

    for other in (replace(record, build_sha256="0" * 64), replace(record, num_stages=3)):
        other.to_json(mlp_copy / "run.json")
        assert main(["report", str(mlp_copy)]) == 0
        out = capsys.readouterr().out
        assert "prediction vs measured" not in out and "is a run of another build" in " ".join(
            out.split()
        ), out


# -- a diverged run stops ----------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_a_nan_loss_stops_the_run_and_keeps_its_record_and_last_good_checkpoint(
    nan_build: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    from fxpipe.runtime.train.checkpoint import checkpoint_meta

    monkeypatch.setenv("FXPIPE_PROBE_NAN_STEPS", "4")
    ck = tmp_path / "ck"
    code = main(
        [
            "run",
            str(nan_build),
            "--steps",
            "8",
            "--checkpoint-dir",
            str(ck),
            "--checkpoint-every",
            "2",
            "--timeout",
            "60",
        ]
    )
    captured = capsys.readouterr()
    assert code == 2
    line = _one_error(captured.err)
    assert (
        "training diverged: the loss of step 4 is nan (computed on stage 1, the last); stopped there"
        in line
    ), line
    assert "the last good checkpoint, after step 2," in line and "(marked stopped)" in line, line
    assert "step    5/8" not in captured.out  # nothing trained after it
    record = RunRecord.from_json(nan_build / "run.json")
    assert record.stopped is not None and "step 4" in record.stopped
    assert (
        len(record.losses) == 3
        and all(v is not None for v in record.losses)
        and len(record.step_seconds) == 4
    )
    assert checkpoint_meta(ck)["step"] == 2  # no checkpoint of the weights the NaN step made


@pytest.mark.slow
@pytest.mark.distributed
def test_under_fp16_the_scaler_skips_a_nan_step_and_the_run_goes_on(
    nan_build: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FXPIPE_PROBE_NAN_STEPS", "2")
    assert (
        main(["run", str(nan_build), "--steps", "3", "--precision", "fp16", "--timeout", "60"]) == 0
    )
    assert "step 2 skipped" in capsys.readouterr().out
    record = RunRecord.from_json(nan_build / "run.json")
    assert (
        record.stopped is None
        and record.losses[1] is None
        and None not in (record.losses[0], record.losses[2])
    )


# -- the user's disk ---------------------------------------------------------------------------------------------


def test_a_disk_fault_is_one_oserror_line_not_an_internal_error() -> None:
    from fxpipe.unexpected import internal_error_line

    line = internal_error_line(
        OSError(errno.ENOSPC, "No space left on device", "b/run.json"), "training"
    )
    assert line.startswith(
        "OSError [Errno 28 ENOSPC] No space left on device: 'b/run.json' while training: the disk "
        "is full"
    ), line
    try:  # raised from another error, as a library wraps it
        try:
            raise OSError(errno.EDQUOT, "Disk quota exceeded")
        except OSError as exc:
            raise RuntimeError("write failed") from exc
    except RuntimeError as exc:
        assert "the disk quota is used up" in internal_error_line(exc, "writing")
    assert internal_error_line(KeyError("x"), "planning").startswith(
        "internal error while planning"
    )


def _mount_tmpfs(folder: Path) -> bool:
    folder.mkdir()
    try:
        return (
            subprocess.run(
                ["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(folder)],
                capture_output=True,
                timeout=20,
                check=False,
            ).returncode
            == 0
        )
    except (OSError, subprocess.TimeoutExpired):
        return False


def test_a_full_disk_while_emitting_a_build_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A 64 KiB tmpfs where this machine lets us mount one; else safetensors' writer failing as it does there."""
    small = tmp_path / "small"
    mounted = _mount_tmpfs(small)
    try:
        if not mounted:
            import safetensors.torch
            from safetensors import SafetensorError

            def full(*args: Any, **kwargs: Any) -> None:
                raise SafetensorError(
                    "Error while serializing: I/O error: No space left on device (os error 28)"
                )

            monkeypatch.setattr(safetensors.torch, "save_file", full)
        assert (
            main(
                [
                    "partition",
                    str(ROOT / "examples" / "charlm.py"),
                    "--stages",
                    "2",
                    "--out",
                    str(small / "build"),
                ]
            )
            == 2
        )
        line = _one_error(capsys.readouterr().err)
        assert (
            "internal error" not in line
            and "No space left on device" in line
            and ".safetensors" in line
        ), line
        assert not (small / "build").exists()
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], capture_output=True, timeout=20, check=False)


class _FullDisk(io.StringIO):
    def write(self, text: str) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")


def test_a_full_log_disk_loses_log_lines_not_the_job(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from fxpipe.runtime.launch import launcher

    job = launcher._Job(proc=None)  # type: ignore[arg-type]
    sink = _FullDisk()
    monkeypatch.setattr(launcher.sys, "stdout", sink)
    launcher._tee(job, io.StringIO("step    1/9  loss 2.0\nstep    2/9  loss 1.9\n"), sink)
    assert (
        not job.output_closed.is_set()
    )  # the job is not stopped, as it is for a reader that went away
    assert job.log_lost is not None and "No space left on device" in job.log_lost
    assert (
        "cannot write standard output: No space left on device; training went on"
        in capsys.readouterr().err
    )
