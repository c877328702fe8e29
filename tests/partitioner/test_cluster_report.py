"""A cluster plan's report does not contradict itself: the link it names, job vs replica throughput, one
row per 1-stage configuration, a warning on CPU unit times priced on GPUs, what "proven optimal" is of."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import pytest

from fxpipe.cli import main
from fxpipe.partitioner.problem import build_problem
from fxpipe.partitioner.search.shapes import enumerate_shapes
from fxpipe.partitioner.solve import planner as planner_module
from fxpipe.partitioner.solve.auto import auto_candidates
from fxpipe.partitioner.solve.solution import Solution
from fxpipe.partitioner.synthetic import transformer_profile


def _profile(trace_device: str):
    profile = transformer_profile(
        layers=6, hidden=128, ffn=512, heads=4, kv_heads=2, vocab=512, seq=512, device_tflops=0.05
    )
    return replace(profile, trace_device=trace_device)


def _plan(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], trace_device: str, *extra: str
) -> str:
    path = tmp_path / "profile.json"
    path.write_text(_profile(trace_device).to_json())
    code = main(
        [
            "plan",
            str(path),
            "--devices",
            "16",
            "--global-batch",
            "64",
            "--optimizer",
            "sgd",
            "--out",
            str(tmp_path / "plan.json"),
            *extra,
        ]
    )
    text = capsys.readouterr().out
    assert code == 0, text
    return " ".join(text.split())  # rich wraps long lines


def test_the_cluster_plan_names_its_links_and_labels_throughput(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _plan(tmp_path, capsys, "cuda")
    assert "chosen with --link" not in text
    assert "inside a node" in text and "--intra-link / --inter-link" in text
    assert "samples/s (job)" in text
    first = re.search(r"│ 1 │ +\d+ x (\d+) │[^│]*│[^│]*│[^│]*│[^│]*│ +([\d.]+) │", text)
    assert first is not None, text
    job = re.search(
        r"throughput ([\d.]+) samples/s for the job \((\d+) samples per step\), ([\d.]+) per replica",
        text,
    )
    assert job is not None, text
    assert float(job.group(1)) == pytest.approx(
        float(first.group(2)), rel=1e-3
    )  # the table's figure, the job's
    assert int(job.group(2)) == 64
    assert float(job.group(3)) * int(first.group(1)) == pytest.approx(float(job.group(1)), rel=1e-2)
    assert "warning:" not in text  # unit times of the cluster's kind of device


def test_cpu_unit_times_priced_on_gpus_are_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _plan(tmp_path, capsys, "cpu")
    assert "warning: the unit times (analytic) are for the CPU this profile was traced on" in text
    assert "--trace-device cuda" in text
    assert "warning:" not in _plan(
        tmp_path, capsys, "cpu", "--intra-link", "loopback", "--inter-link", "loopback"
    )


def test_a_one_stage_pipeline_is_searched_with_one_schedule() -> None:
    shapes = enumerate_shapes(12, 4, 16, auto_candidates(), range(1, 5))
    one = [s for s in shapes if s.stages == 1]
    assert one and {(s.schedule, s.virtual_stages) for s in one} == {("1f1b", 1)}
    assert len({(s.replicas, s.microbatches) for s in one}) == len(one)
    assert (
        len({s.schedule for s in shapes if s.stages == 2}) > 1
    )  # deeper pipelines still try every schedule
    gpipe_only = enumerate_shapes(12, 4, 16, [("gpipe", 1)], range(1, 2))
    assert {s.schedule for s in gpipe_only} == {"gpipe"}


def test_proven_optimal_says_of_which_split() -> None:
    """A plan that keeps a split with a larger bottleneck than the solver's proven one says whose bottleneck
    the proof is of, beside the plan's gap."""
    from partition_fixtures import chain_profile

    problem = build_problem(chain_profile([1.0, 1.0, 1.0, 1.0]), 2)
    even = Solution((0, 0, 1, 1), solver="dp", optimal=True, status="proven optimal")
    uneven = Solution((0, 1, 1, 1), solver="uniform")
    steps = {even.assignment: 106.0, uneven.assignment: 100.0}
    pick = planner_module._pick_fastest(
        problem, even, {"uniform": uneven}, steps.__getitem__, 0.0, 0.05
    )
    assert pick.assignment == uneven.assignment and not pick.optimal
    assert pick.status.startswith("proven optimal for the dp split's bottleneck (2 ms); kept")
