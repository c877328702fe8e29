"""The progress bar the launcher draws from the workers' progress lines, and ``--tensorboard`` event files."""

from __future__ import annotations

import importlib.util
import io
from pathlib import Path
from typing import Any

import pytest

from builds import make_build
from fxpipe.errors import ConfigError
from fxpipe.runtime.train.run_options import RunOptions
from fxpipe.runtime.train.log import ProgressBar, check_tensorboard, progress_line, render_progress
from fxpipe.runtime.train.training_options import TrainingOptions
from spawn import spawn

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")
CLEAR = "\r\033[K"


def test_the_launcher_redraws_the_bar_in_place_and_keeps_plain_lines() -> None:
    from fxpipe.runtime.launch.launcher import _Job, _tee

    lines = [
        progress_line(1, 3, 4.0, 2.0) + "\n",
        "step    1/3  loss 4.0\n",
        progress_line(2, 3, 3.5, 1.0) + "\n",
        progress_line(3, 3, 3.0, 0.0) + "\n",
        "median step 1.00 ms\n",
    ]
    sink = io.StringIO()
    _tee(_Job(proc=None), iter(lines), sink)  # type: ignore[arg-type]
    bars = [render_progress(line) for line in lines]
    assert sink.getvalue() == (
        f"{CLEAR}{bars[0]}{CLEAR}step    1/3  loss 4.0\n{CLEAR}{bars[2]}{CLEAR}{bars[3]}\n"
        "median step 1.00 ms\n"
    )
    assert bars[3] is not None and bars[3].startswith("[" + "#" * 30 + "]    3/3  loss 3.000000")
    assert (
        render_progress("step 1/3 loss 4.0") is None
        and render_progress("fxpipe-progress: {") is None
    )


def test_a_plain_line_after_the_bar_clears_it_once() -> None:
    bar, sink = ProgressBar(), io.StringIO()
    assert (
        bar.draw(progress_line(1, 2, 1.0, 1.0), sink)
        and not bar.draw("a\n", sink)
        and not bar.draw("b\n", sink)
    )
    assert sink.getvalue().count(CLEAR) == 2  # the bar, then one clear before "a"


def test_tensorboard_missing_is_one_line_before_launch(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tensorboard" else real(name, *a),
    )
    with pytest.raises(
        ConfigError, match="--tensorboard needs the tensorboard package.*pip install tensorboard"
    ):
        check_tensorboard("runs")
    check_tensorboard(None)  # not asked for: nothing to check


def _job(rank: int, world: int, build: str, options: RunOptions) -> Any:
    from fxpipe.runtime.train.loop import train

    return train(Path(build), options)


@pytest.mark.distributed
def test_tensorboard_events_hold_the_runs_loss_lr_grad_norm_and_eval(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")  # an optional extra: fxpipe[tensorboard]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    build = make_build("charlm", tmp_path / "build", 2, 8, 2)
    board = tmp_path / "tb"
    options = RunOptions(
        steps=4,
        lr=3e-3,
        timeout_s=60,
        training=TrainingOptions(
            optimizer="adamw", clip_grad_norm=0.5, eval_every=2, tensorboard=str(board)
        ),
    )
    record = spawn(_job, 2, str(build), options, timeout=240)[0].value
    events = EventAccumulator(str(board))
    events.Reload()
    scalars = {
        tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
    }
    assert set(scalars) == {
        "train/loss",
        "train/lr",
        "train/grad_norm",
        "train/samples_per_s",
        "train/step_ms",
        "eval/loss",
    }
    assert [s for s, _ in scalars["train/loss"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["train/loss"]] == pytest.approx(record.losses, rel=1e-6)
    assert [v for _, v in scalars["train/grad_norm"]] == pytest.approx(record.grad_norms, rel=1e-6)
    assert [v for _, v in scalars["train/lr"]] == pytest.approx(record.lrs, rel=1e-6)
    assert [s for s, _ in scalars["eval/loss"]] == [s for s, _ in record.eval_losses] == [2, 4]
    assert [v for _, v in scalars["eval/loss"]] == pytest.approx(
        [v for _, v in record.eval_losses], rel=1e-6
    )
    assert all(v > 0 for _, v in scalars["train/samples_per_s"])
