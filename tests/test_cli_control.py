"""Manual control from the command line: ``--split-at`` on ``plan``, and ``plan --html``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxpipe.cli import main
from fxpipe.partitioner import PartitionPlan
from fxpipe.tracer.profile import ModelProfile, TensorSpec, Unit, UnitEdge


def _profile(path: Path, n: int = 8) -> Path:
    units = tuple(
        Unit(
            name=f"u{i}",
            module_path=f"layers.{i}",
            fwd_ms=1.0,
            bwd_ms=2.0,
            outputs=(TensorSpec((1, 16)),),
        )
        for i in range(n)
    )
    edges = tuple(UnitEdge(f"u{i}", f"u{i + 1}", 64) for i in range(n - 1))
    ModelProfile(units=units, edges=edges, batch_size=1).to_json(path)
    return path


def test_plan_split_at_and_html(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = _profile(tmp_path / "profile.json")
    out, html = tmp_path / "plan.json", tmp_path / "r" / "report.html"
    code = main(
        [
            "plan",
            str(profile),
            "--stages",
            "3",
            "--split-at",
            "layers.2",
            "--split-at",
            "layers.7",
            "--out",
            str(out),
            "--html",
            str(html),
        ]
    )
    assert code == 0, capsys.readouterr().err
    plan = PartitionPlan.from_json(out)
    assert [list(s.units) for s in plan.stages] == [
        ["u0", "u1"],
        ["u2", "u3", "u4", "u5", "u6"],
        ["u7"],
    ]
    assert html.read_text().startswith("<!DOCTYPE html>")
    assert str(html) in capsys.readouterr().out


@pytest.mark.parametrize(
    "extra, fragment",
    [
        (
            ["--split-at", "layers.1", "--split-at", "layer.3"],
            "error: --split-at 'layer.3' matches no unit's module path; did you mean 'layers.3'",
        ),
        (["--split-at", "layers.3"], "error: 1 --split-at point make 2 stages, but the plan has 3"),
    ],
)
def test_bad_split_points_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], extra: list[str], fragment: str
) -> None:
    profile = _profile(tmp_path / "profile.json")
    code = main(
        ["plan", str(profile), "--stages", "3", "--out", str(tmp_path / "plan.json"), *extra]
    )
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(fragment) and len(err.splitlines()) == 1


def test_report_sets_run_json_beside_the_prediction(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fxpipe.partitioner import plan_partition
    from fxpipe.runtime.train.run_record import RunRecord

    profile = ModelProfile.from_json(_profile(tmp_path / "profile.json"))
    plan = plan_partition(profile, 2, microbatches=2)
    plan.to_json(tmp_path / "plan.json")
    assert plan.prediction is not None
    peaks = plan.prediction.peak_memory_bytes
    RunRecord(
        losses=(1.0, 0.9),
        step_seconds=(0.1, 0.1),
        median_step_ms=2.5 * plan.step_ms,
        samples_per_second=10.0,
        schedule=plan.schedule,
        microbatches=2,
        batch_size=4,
        lr=0.1,
        world_size=2,
        num_stages=2,
        device="cpu",
        backend="gloo",
        predicted_step_ms=plan.step_ms,
        peak_memory_bytes=(10**8, 10**8),
        peak_tensor_bytes=tuple(int(1.1 * p) for p in peaks),
        dp=1,
        global_batch_size=4,
        comm_hook="allreduce",
        powersgd_rank=1,
        shard_optimizer_state=False,
        backward_passes_per_step=1,
    ).to_json(tmp_path / "run.json")
    assert main(["report", str(tmp_path), "--html"]) == 0
    out = capsys.readouterr().out
    assert (
        "prediction vs measured" in out
        and f"{plan.step_ms:.2f}" in out
        and f"{2.5 * plan.step_ms:.2f}" in out
    )
    assert "2.50x (disagree)" in out and "1.10x" in out and "1.10x (disagree)" not in out
    assert "link loopback" in out and "the default for a cpu trace" in out
    html = (tmp_path / "report.html").read_text()
    assert "Prediction vs measured" in html and '<tr class="off">' in html and "2.50x" in html


def test_the_link_follows_the_trace_device(tmp_path: Path) -> None:
    from dataclasses import replace

    from fxpipe.partitioner import plan_partition

    profile = ModelProfile.from_json(_profile(tmp_path / "profile.json"))
    assert plan_partition(profile, 2).cost.link == "loopback"
    assert plan_partition(replace(profile, trace_device="cuda"), 2).cost.link == "nvlink"
    cuda = tmp_path / "cuda.json"
    replace(profile, trace_device="cuda").to_json(cuda)
    for extra, link in (([], "nvlink"), (["--link", "pcie"], "pcie")):
        assert (
            main(["plan", str(cuda), "--stages", "2", "--out", str(tmp_path / "plan.json"), *extra])
            == 0
        )
        assert PartitionPlan.from_json(tmp_path / "plan.json").cost.link == link
