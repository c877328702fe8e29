"""``RunOptions``: validation, the JSON round trip, one set of defaults and one parser for `fxpipe run` and the worker."""

from __future__ import annotations

import argparse
import inspect
import json
import subprocess
import sys
from pathlib import Path

import pytest

from fxpipe.cli import build_parser
from fxpipe.errors import ConfigError
from fxpipe.partitioner.schedule import SCHEDULE_NAMES
from fxpipe.runtime.dataparallel import DataParallelOptions
from fxpipe.runtime.train.run_options import RunOptions, add_run_arguments, run_options_from_args
from fxpipe.runtime.pipeline.runner import PipelineRunner
from fxpipe.runtime.pipeline.schedule import SCHEDULES
from fxpipe.runtime.launch.worker import parse_args as worker_args

SOME = RunOptions(
    steps=4,
    schedule="gpipe",
    microbatches=2,
    batch_size=8,
    lr=0.5,
    timeout_s=30.0,
    device="cpu",
    dp=2,
    data_parallel=DataParallelOptions(
        comm_hook="powersgd",
        powersgd_rank=2,
        shard_optimizer_state=True,
        backward_passes_per_step=2,
    ),
)
SOME_FLAGS = [
    "--steps",
    "4",
    "--schedule",
    "gpipe",
    "--microbatches",
    "2",
    "--batch-size",
    "8",
    "--lr",
    "0.5",
    "--timeout",
    "30",
    "--device",
    "cpu",
    "--dp",
    "2",
    "--comm-hook",
    "powersgd",
    "--powersgd-rank",
    "2",
    "--shard-optimizer-state",
    "--backward-passes-per-step",
    "2",
]


def _cli(*flags: str) -> RunOptions:
    return run_options_from_args(build_parser().parse_args(["run", "build", *flags]))


def _worker(*flags: str) -> RunOptions:
    return run_options_from_args(worker_args(["build", *flags]))


def test_one_set_of_defaults_for_the_cli_the_worker_and_the_runner() -> None:
    assert (
        RunOptions().steps == 10
        and RunOptions().timeout_s == 300.0
        and RunOptions().schedule is None
    )
    assert _cli() == _worker() == RunOptions()
    runner = inspect.signature(PipelineRunner).parameters
    assert runner["schedule"].default == RunOptions().schedule
    assert runner["timeout_s"].default == RunOptions().timeout_s


def test_cli_and_worker_read_the_same_flags_into_the_same_options() -> None:
    assert _cli(*SOME_FLAGS) == _worker(*SOME_FLAGS) == SOME


def test_options_file_with_flags_overriding_it(tmp_path: Path) -> None:
    path = tmp_path / "options.json"
    SOME.to_json(path)
    assert _worker("--options", str(path)) == _cli("--options", str(path)) == SOME
    # a flag overrides its field and nothing else, nested ones included
    got = _worker("--options", str(path), "--steps", "6", "--comm-hook", "batched_powersgd")
    assert got.steps == 6 and got.data_parallel.comm_hook == "batched_powersgd"
    assert got.data_parallel.powersgd_rank == 2 and got.schedule == "gpipe"
    assert _worker("--options", '{"steps": 2}') == RunOptions(steps=2)  # JSON text works too
    with pytest.raises(ConfigError, match="--options file .*nope.json' does not exist"):
        _worker("--options", str(tmp_path / "nope.json"))


def test_json_round_trip_and_partial_data() -> None:
    assert RunOptions.from_json(SOME.to_json()) == SOME
    assert RunOptions.from_dict(RunOptions().to_dict()) == RunOptions()
    data = json.loads(SOME.to_json())
    assert data["schema_version"] == 1 and data["data_parallel"]["comm_hook"] == "powersgd"
    assert RunOptions.from_dict(
        {"steps": 3, "data_parallel": {"comm_hook": "fp16"}, "dp": 2}
    ) == RunOptions(steps=3, dp=2, data_parallel=DataParallelOptions(comm_hook="fp16"))


@pytest.mark.parametrize(
    "data, message",
    [
        ({"stpes": 3}, r"unknown run options \['stpes'\]; expected some of \['steps'"),
        ({"data_parallel": {"hook": "fp16"}}, r"unknown data-parallel options \['hook'\]"),
        (
            {"schema_version": 99},
            r"run options schema version 99 is newer than this fxpipe understands \(1\)",
        ),
    ],
)
def test_bad_json_is_refused_by_name(data: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunOptions.from_dict(data)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"steps": 0}, r"--steps must be an int >= 1 \(training steps\), got 0"),
        ({"steps": 2.5}, r"--steps must be an int >= 1"),
        (
            {"schedule": "zb"},
            r"unknown schedule 'zb'; expected one of \['gpipe', '1f1b', 'interleaved-1f1b', 'zb-h1'",
        ),
        ({"virtual_stages": 0}, r"--virtual-stages must be an int >= 1 \(stages per rank\), got 0"),
        (
            {"microbatches": 0},
            r"--microbatches must be an int >= 1, got 0; leave it out to use the build's",
        ),
        ({"batch_size": -4}, r"--batch-size must be an int >= 1, got -4"),
        ({"lr": float("nan")}, r"--lr must be a number >= 0"),
        ({"timeout_s": 0}, r"--timeout must be a positive number of seconds, got 0"),
        ({"device": "gpu"}, r"--device must be 'cpu', 'cuda' or 'cuda:N', got 'gpu'"),
        ({"dp": 0}, r"--dp must be an int >= 1 \(the number of pipeline replicas\), got 0; use 1"),
        ({"dp": True}, r"--dp must be an int >= 1"),
        (
            {"data_parallel": {"comm_hook": "fp16"}},
            r"data_parallel must be DataParallelOptions, got dict",
        ),
        (
            {"dp": 1, "data_parallel": DataParallelOptions(comm_hook="fp16")},
            r"comm_hook='fp16' only apply with 2 or more pipeline replicas",
        ),
        (
            {"steps": 3, "dp": 2, "data_parallel": DataParallelOptions(backward_passes_per_step=2)},
            r"--steps 3 is not a multiple of --backward-passes-per-step 2.*use --steps 4",
        ),
    ],
)
def test_validation_names_the_value_and_the_remedy(fields: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        RunOptions(**fields)


def test_replica_checks_wait_until_the_replicas_are_known() -> None:
    """dp=None is resolved later (1 for `fxpipe run`, the world for torchrun), which checks the options then."""
    options = RunOptions(data_parallel=DataParallelOptions(comm_hook="fp16"))
    assert options.dp is None
    assert RunOptions(device="cuda:1").device == "cuda:1"


def test_schedule_names_have_one_source() -> None:
    assert set(SCHEDULES) == set(SCHEDULE_NAMES)
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    assert (
        tuple(next(a.choices for a in parser._actions if "--schedule" in a.option_strings))
        == SCHEDULE_NAMES
    )
    assert (
        "pipeline schedule: gpipe, 1f1b, interleaved-1f1b, zb-h1, zbv, dualpipev (default: the build's)"
        in " ".join(parser.format_help().split())
    )


def test_building_the_cli_parser_imports_neither_torch_nor_or_tools() -> None:
    """Every verb's parser is built at start-up: `fxpipe --help` stays fast."""
    code = (
        "import sys, fxpipe.cli; fxpipe.cli.build_parser(); "
        "print(sorted(m for m in ('torch', 'ortools', 'networkx', 'numpy') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
