"""Manual control from the command line: ``--split-at`` on ``plan``, and ``plan --html``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxpipe.cli import main
from fxpipe.partitioner import PartitionPlan
from fxpipe.tracer.profile import ModelProfile, TensorSpec, Unit, UnitEdge


def _profile(path: Path, n: int = 8) -> Path:
    units = tuple(Unit(name=f"u{i}", module_path=f"layers.{i}", fwd_ms=1.0, bwd_ms=2.0,
                       outputs=(TensorSpec((1, 16)),)) for i in range(n))
    edges = tuple(UnitEdge(f"u{i}", f"u{i + 1}", 64) for i in range(n - 1))
    ModelProfile(units=units, edges=edges, batch_size=1).to_json(path)
    return path


def test_plan_split_at_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = _profile(tmp_path / "profile.json")
    out, html = tmp_path / "plan.json", tmp_path / "r" / "report.html"
    code = main(["plan", str(profile), "--stages", "3", "--split-at", "layers.2", "--split-at", "layers.7",
                 "--out", str(out), "--html", str(html)])
    assert code == 0, capsys.readouterr().err
    plan = PartitionPlan.from_json(out)
    assert [list(s.units) for s in plan.stages] == [["u0", "u1"], ["u2", "u3", "u4", "u5", "u6"], ["u7"]]
    assert html.read_text().startswith("<!DOCTYPE html>")
    assert str(html) in capsys.readouterr().out


@pytest.mark.parametrize("extra, fragment", [
    (["--split-at", "layers.1", "--split-at", "layer.3"], "error: --split-at 'layer.3' matches no unit's module path; did you mean 'layers.3'"),
    (["--split-at", "layers.3"], "error: 1 --split-at point make 2 stages, but the plan has 3"),
])
def test_bad_split_points_are_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                                       fragment: str) -> None:
    profile = _profile(tmp_path / "profile.json")
    code = main(["plan", str(profile), "--stages", "3", "--out", str(tmp_path / "plan.json"), *extra])
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(fragment) and len(err.splitlines()) == 1
