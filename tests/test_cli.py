"""The command line: each verb end to end, and bad input as one line with exit 2."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxpipe.cli import main

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _fxpipe(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fxpipe", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
    )


def test_trace_writes_profile_and_prints_table(tmp_path: Path) -> None:
    out = tmp_path / "profile.json"
    proc = _fxpipe("trace", str(EXAMPLES / "mlp.py"), "--batch-size", "4", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["batch_size"] == 4
    assert len(data["units"]) >= 3
    assert all(
        {"name", "fwd_ms", "bwd_ms", "param_bytes", "activation_bytes", "outputs"} <= set(u)
        for u in data["units"]
    )
    assert "wrote" in proc.stdout


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["trace", "does/not/exist.py"], "does not exist"),
        (["trace", "examples/mlp.py:no_such_fn"], "no function no_such_fn"),
        (["trace", "examples/mlp.py", "--inputs-fn", "nope"], "no function nope"),
        (["plan", "missing-profile.json", "--stages", "2"], "does not exist"),
        (["verify", "no-such-build-dir"], "does not exist"),
        (["run", "no-such-build", "--dp", "2"], "does not exist"),
    ],
)
def test_bad_input_is_one_line_exit_2(
    args: list[str], fragment: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import os

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        code = main(args)
    finally:
        os.chdir(cwd)
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and fragment in err
    assert len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_debug_flag_shows_traceback(capsys: pytest.CaptureFixture[str]) -> None:
    from fxpipe.errors import ModelFileError

    with pytest.raises(ModelFileError):
        main(["--debug", "trace", "does/not/exist.py"])


def test_plan_with_dp_prices_the_gradient_all_reduce(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    assert (
        main(["trace", str(EXAMPLES / "mlp.py"), "--batch-size", "2", "--out", str(profile)]) == 0
    )
    plans = {}
    for name, extra in {
        "single": [],
        "dp2": ["--dp", "2"],
        "dp2_fp16": ["--dp", "2", "--comm-hook", "fp16"],
        "dp2_powersgd": ["--dp", "2", "--comm-hook", "powersgd", "--powersgd-rank", "2"],
    }.items():
        out = tmp_path / f"{name}.json"
        # one split for all: the cheapest split may move with the data-parallel costs (DDP's pass per tensor)
        assert (
            main(
                [
                    "plan",
                    str(profile),
                    "--stages",
                    "2",
                    "--solver",
                    "dp",
                    "--split-at",
                    "layers.1.0",
                    "--out",
                    str(out),
                    *extra,
                ]
            )
            == 0
        )
        plans[name] = json.loads(out.read_text())
    capsys.readouterr()
    assert {p["stages"][1]["units"][0] for p in plans.values()} == {"layers.1.0"}
    assert plans["single"]["cost"]["dp_replicas"] == 1
    assert (
        plans["dp2_powersgd"]["cost"].items()
        >= {"dp_replicas": 2, "comm_hook": "powersgd", "powersgd_rank": 2}.items()
    )
    overhead = {
        k: p["prediction"]["step_overhead_ms"]["dp_all_reduce_ms"] for k, p in plans.items()
    }
    step = {k: p["prediction"]["step_ms"]["1f1b"] for k, p in plans.items()}
    assert overhead["single"] == 0 and overhead["dp2"] > overhead["dp2_fp16"] > 0
    # the all-reduce is per step, not per microbatch: the stages' microbatch figures stay as they were
    per_step = ("dp_allreduce_ms", "dp_bytes")
    per_microbatch = [
        {k: v for k, v in s.items() if k not in per_step} for s in plans["dp2"]["stages"]
    ]
    assert [
        {k: v for k, v in s.items() if k not in per_step} for s in plans["single"]["stages"]
    ] == per_microbatch
    assert all(s["dp_allreduce_ms"] == 0 for s in plans["single"]["stages"])
    assert all(s["dp_allreduce_ms"] > 0 for s in plans["dp2"]["stages"])
    assert step["dp2"] == pytest.approx(step["single"] + overhead["dp2"])


def test_plan_for_a_schedule_with_virtual_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    assert (
        main(["trace", str(EXAMPLES / "mlp.py"), "--batch-size", "2", "--out", str(profile)]) == 0
    )
    out = tmp_path / "zbv.json"
    assert (
        main(["plan", str(profile), "--stages", "2", "--schedule", "zbv", "--out", str(out)]) == 0
    )
    plan = json.loads(out.read_text())
    assert (plan["virtual_stages"], plan["placement"], plan["num_stages"]) == (2, "v", 4)
    assert [s["rank"] for s in plan["stages"]] == [0, 1, 1, 0] and set(
        plan["prediction"]["step_ms"]
    ) == {"zbv", "dualpipev"}
    assert "optimal for: planned for the predicted step time of zbv" in " ".join(
        capsys.readouterr().out.split()
    )
    auto = tmp_path / "auto.json"
    assert (
        main(
            [
                "plan",
                str(profile),
                "--stages",
                "2",
                "--schedule",
                "auto",
                "--virtual-stages",
                "2",
                "--out",
                str(auto),
            ]
        )
        == 0
    )
    assert {o["schedule"] for o in json.loads(auto.read_text())["alternatives"]} == {
        "interleaved-1f1b",
        "zbv",
        "dualpipev",
    }
    assert "schedules planned by --schedule auto" in capsys.readouterr().out
    assert (
        main(["plan", str(profile), "--stages", "2", "--schedule", "zbv", "--virtual-stages", "3"])
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "'zbv' runs 2 stages per rank, not --virtual-stages 3" in err
        and len(err.strip().splitlines()) == 1
    )


_BAD_MODEL = (
    "import torch\n"
    "def build_model():\n    raise RuntimeError('boom in init')\n"
    "def linear():\n    return torch.nn.Linear(4, 4)\n"
    "def example_inputs(b):\n    return (torch.zeros(b, 3),)\n"
    "def wrong_width(b):\n    return (torch.randn(b, 5),)\n"
    "def not_a_tensor(b):\n    return 'not a tensor'\n"
    "def text_inputs(b):\n    return ('hello',)\n"
)


@pytest.mark.parametrize(
    "args, fragments",
    [
        ([], ["boom in init"]),
        (
            [":linear", "--inputs-fn", "not_a_tensor"],
            ["return a tuple of positional arguments, a dict of keyword arguments"],
        ),
        (
            [":linear", "--inputs-fn", "wrong_width", "--batch-size", "3"],
            [
                "bad.py",
                "Linear raised on its example inputs (float32[3, 5])",
                "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x5 and 4x4)",
            ],
        ),
        ([":linear", "--inputs-fn", "text_inputs"], ["no argument is a tensor ('hello')"]),
    ],
    ids=["raises", "not-a-tuple", "rejects-its-inputs", "no-tensor"],
)
def test_a_bad_model_file_is_one_line_exit_2(
    args: list[str], fragments: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the model file's functions raise or return wrongly: one line, exit 2."""
    bad = tmp_path / "bad.py"
    bad.write_text(_BAD_MODEL)
    target, *rest = args or [""]
    argv = ["trace", f"{bad}{target}", *rest, "--out", str(tmp_path / "p.json")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err and all(f in err for f in fragments), err


def test_sequence_first_model_partitions_and_verifies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "seq_first.py"
    model.write_text(
        "import torch\nimport torch.nn as nn\n"
        "class SeqFirst(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.inp, self.out = nn.Linear(8, 8), nn.Linear(8, 8)\n"
        "    def forward(self, x, mask):\n"
        "        return self.out(torch.einsum('st,tbc->sbc', mask, torch.relu(self.inp(x))))\n"
        "def build_model():\n    return SeqFirst()\n"
        "def example_inputs(b):\n    return torch.randn(6, b, 8), torch.tril(torch.ones(6, 6))\n"
        "def example_targets(b):\n    return torch.randn(6, b, 8)\n"
        "def loss_fn(out, target):\n    return ((out - target) ** 2).mean()\n"
    )
    build = tmp_path / "build"
    assert (
        main(["partition", str(model), "--stages", "2", "--batch-size", "4", "--out", str(build)])
        == 0
    )
    manifest = json.loads((build / "manifest.json").read_text())
    assert [(t["shape"], t["batch_dim"]) for t in manifest["inputs"]] == [
        ([6, 2, 8], 1),
        ([6, 6], None),
    ]
    assert main(["verify", str(build)]) == 0
    assert "OK" in capsys.readouterr().out


def test_memory_limit_holds_over_the_whole_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Note [fitting memory over time]: a limit the stage bound meets but the schedule walk does not is one line."""
    profile = tmp_path / "profile.json"
    assert (
        main(["trace", str(EXAMPLES / "mlp.py"), "--batch-size", "4", "--out", str(profile)]) == 0
    )
    out = tmp_path / "plan.json"
    assert (
        main(["plan", str(profile), "--stages", "2", "--microbatches", "4", "--out", str(out)]) == 0
    )
    unlimited = json.loads(out.read_text())
    own_walk = max(unlimited["prediction"]["peak_memory_bytes_by_schedule"]["1f1b"])
    units = [u for stage in unlimited["stages"] for u in stage["units"]]
    peaks = []  # every split: the stage bound's rank memory and the walk's, under 1F1B
    for first in units[1:]:
        assert (
            main(
                [
                    "plan",
                    str(profile),
                    "--stages",
                    "2",
                    "--microbatches",
                    "4",
                    "--split-at",
                    first,
                    "--out",
                    str(out),
                ]
            )
            == 0
        )
        plan = json.loads(out.read_text())
        peaks.append(
            (
                max(plan["rank_memory_bytes"]),
                max(plan["prediction"]["peak_memory_bytes_by_schedule"]["1f1b"]),
            )
        )
    assert all(
        walk > bound for bound, walk in peaks
    )  # the walk counts what the stage bound leaves out
    walked = min(walk for _, walk in peaks)
    limit = walked - 1  # the stage bound of some split meets it, no split's walk does
    assert min(bound for bound, _ in peaks) <= limit
    capsys.readouterr()
    assert (
        main(
            [
                "plan",
                str(profile),
                "--stages",
                "2",
                "--microbatches",
                "4",
                "--memory-limit",
                str(limit),
                "--out",
                str(out),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "over the whole step" in err and len(err.strip().splitlines()) == 1
    assert (
        main(
            [
                "plan",
                str(profile),
                "--stages",
                "2",
                "--microbatches",
                "4",
                "--memory-limit",
                str(own_walk),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    fitted = json.loads(out.read_text())
    assert max(fitted["prediction"]["peak_memory_bytes_by_schedule"]["1f1b"]) <= own_walk
    assert "peak memory over the step" in fitted["status"]
