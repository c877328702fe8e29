"""``fxpipe run`` says a step prediction only where the plan stands behind one (Note [analytic CPU estimate]),
and names other work on a CPU host beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from builds import make_build
from fxpipe.runtime.launch.launcher import run_build
from fxpipe.runtime.train import loop
from fxpipe.runtime.train.run_options import RunOptions

pytestmark = pytest.mark.filterwarnings("ignore:fxpipe. symbolic tracing failed")


@pytest.mark.distributed
@pytest.mark.slow
def test_an_analytic_cpu_plan_records_no_predicted_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    build = make_build(
        "mlp", tmp_path / "mlp", stages=2, batch_size=4, microbatches=2
    )  # analytic unit times
    result = run_build(build, RunOptions(steps=2, lr=0.1, timeout_s=120))
    printed = capsys.readouterr().out
    assert result.predicted_step_ms is None
    assert "plan predicted" not in printed
    assert (
        "the plan's analytic CPU estimate ranks splits, it predicts no time: --measure-times does"
        in printed
    )


def test_a_busy_cpu_host_is_named_beside_the_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(loop.os, "cpu_count", lambda: 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(loop.os, "getloadavg", lambda: (9.1, 8.0, 7.0))
    note = loop._host_load_note("cpu")
    assert (
        note
        == "; this host's load average was 9.1 on 2 cores for 2 ranks: the prediction assumes no other work on them"
    )
    assert loop._host_load_note("cuda") == ""
    monkeypatch.setattr(loop.os, "getloadavg", lambda: (2.5, 2.0, 2.0))
    assert loop._host_load_note("cpu") == ""
