"""Bad command-line values and bad model files: one ``error:`` line naming the right thing, exit 2, no traceback.

(Bad JSON artifacts, field by field, are tests/test_artifact_schemas.py; here the values a
user types and the model files a user writes.)
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fxpipe.cli import main

MLP = str(Path(__file__).resolve().parents[2] / "examples" / "mlp.py")


def _one_line(capsys: pytest.CaptureFixture[str], argv: list[str], code: int = 2) -> str:
    assert main(argv) == code
    err = capsys.readouterr().err
    assert (
        err.startswith("error: ") and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    ), err
    return err


@pytest.fixture(scope="module")
def profile(mlp_project: Path) -> Path:
    return mlp_project / "build" / "profile.json"


PLAN_VALUES = [
    (["--stages", "0"], "--stages must be >= 1, got 0"),
    (["--stages", "-3"], "--stages must be >= 1, got -3"),
    (["--stages", "99"], "cannot split"),
    (["--stages", "2", "--microbatches", "0"], "microbatches must be >= 1, got 0"),
    (["--stages", "2", "--memory-limit", "1e999GB"], "not a finite number of bytes"),
    (["--stages", "2", "--memory-limit", "nanGB"], "cannot read size 'nanGB'"),
    (["--stages", "2", "--memory-limit=-5GB"], "cannot read size '-5GB'"),
    (["--stages", "2", "--memory-limit", "lots"], "cannot read size 'lots'"),
    (["--stages", "2", "--memory-limit", "1B"], "the least that fits 2 stages is"),
    (
        ["--stages", "2", "--speed-factors", "nan,1"],
        "--speed-factors 'nan,1' must be finite numbers > 0",
    ),
    (
        ["--stages", "2", "--speed-factors", "1,inf"],
        "--speed-factors '1,inf' must be finite numbers > 0",
    ),
    (
        ["--stages", "2", "--speed-factors", "0,1"],
        "--speed-factors '0,1' must be finite numbers > 0",
    ),
    (["--stages", "2", "--speed-factors", "a,b"], "must be numbers separated by commas"),
    (["--stages", "2", "--speed-factors", "1"], "lists 1 factors but there are 2 stages"),
    (
        ["--stages", "2", "--link-bandwidth", "nan"],
        "--link-bandwidth must be a finite number, got nan",
    ),
    (
        ["--stages", "2", "--link-bandwidth", "inf"],
        "--link-bandwidth must be a finite number, got inf",
    ),
    (["--stages", "2", "--link-bandwidth", "0"], "link_bandwidth must be > 0"),
    (["--stages", "2", "--link-latency", "inf"], "--link-latency must be a finite number, got inf"),
    (["--stages", "2", "--link-latency", "-1"], "link_latency must be >= 0"),
    (["--stages", "2", "--time-limit", "nan"], "--time-limit must be a finite number, got nan"),
    (["--stages", "2", "--time-limit", "0"], "time_limit must be a finite number of seconds > 0"),
    (["--stages", "2", "--dp", "0"], "dp_replicas must be an int >= 1, got 0"),
    (["--stages", "2", "--dp", "2", "--comm-hook", "zip"], "unknown comm_hook 'zip'"),
    (["--stages", "2", "--link", "carrier-pigeon"], "unknown link preset 'carrier-pigeon'"),
]


@pytest.mark.parametrize(
    ("args", "fragment"), PLAN_VALUES, ids=[" ".join(a) for a, _ in PLAN_VALUES]
)
def test_plan_values(
    args: list[str],
    fragment: str,
    profile: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "plan.json"
    assert fragment in _one_line(capsys, ["plan", str(profile), *args, "--out", str(out)])
    assert not out.exists()


RUN_VALUES = [
    (["--steps", "0"], "--steps must be an int >= 1"),
    (["--lr", "nan"], "--lr must be a number >= 0"),
    (["--lr", "-1"], "--lr must be a number >= 0"),
    (["--timeout", "0"], "--timeout must be a positive number of seconds"),
    (["--timeout", "nan"], "--timeout must be a positive number of seconds"),
    (["--timeout", "1e12"], "--timeout must be at most 1e+08 seconds"),
    (["--microbatches", "0"], "--microbatches must be an int >= 1"),
    (["--batch-size", "0"], "--batch-size must be an int >= 1"),
    (["--dp", "0"], "--dp must be an int >= 1"),
    (["--device", "tpu"], "--device must be 'cpu', 'cuda' or 'cuda:N'"),
]


@pytest.mark.parametrize(("args", "fragment"), RUN_VALUES, ids=[" ".join(a) for a, _ in RUN_VALUES])
def test_run_values_are_refused_before_any_process_starts(
    args: list[str], fragment: str, mlp_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fragment in _one_line(capsys, ["run", str(mlp_copy), *args])
    assert not (mlp_copy / "run.json").exists()


def test_run_on_a_cuda_device_this_machine_lacks(
    mlp_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert "sees no CUDA device" in _one_line(capsys, ["run", str(mlp_copy), "--device", "cuda"])


@pytest.mark.parametrize("option", ["--rtol", "--atol"])
@pytest.mark.parametrize("value", ["nan", "-1", "inf"])
def test_verify_tolerances(
    option: str, value: str, mlp_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert f"{option} must be a finite number >= 0" in _one_line(
        capsys, ["verify", str(mlp_copy), option, value]
    )


def test_partition_stages_zero_blames_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _one_line(capsys, ["partition", MLP, "--stages", "0", "--out", str(tmp_path / "b")])
    assert "--stages must be >= 1, got 0" in err and "microbatches" not in err


def test_partition_batch_not_a_multiple(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    err = _one_line(
        capsys,
        ["partition", MLP, "--stages", "2", "--batch-size", "3", "--out", str(tmp_path / "b")],
    )
    assert "--batch-size 3 must be a positive multiple of --microbatches 2" in err


@pytest.mark.parametrize("verb", ["trace", "plan"])
def test_out_naming_a_directory(
    verb: str, profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = [MLP] if verb == "trace" else [str(profile), "--stages", "2"]
    assert "is a directory; name a file" in _one_line(
        capsys, [verb, *source, "--out", str(tmp_path)]
    )


def test_out_below_a_file(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "file").write_text("")
    err = _one_line(
        capsys,
        ["plan", str(profile), "--stages", "2", "--out", str(tmp_path / "file" / "plan.json")],
    )
    assert "cannot create its folder" in err


def test_partition_out_naming_a_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "file").write_text("keep me")
    err = _one_line(capsys, ["partition", MLP, "--stages", "2", "--out", str(tmp_path / "file")])
    assert "is a file, not a directory" in err and (tmp_path / "file").read_text() == "keep me"


MODEL_FILES = {
    "sys.exit() at import": ("import sys\nsys.exit(3)\n", "it called sys.exit(3)"),
    "raises at import": (
        "raise RuntimeError('no import for you')\n",
        "RuntimeError: no import for you",
    ),
    "syntax error": ("def build_model(:\n", "SyntaxError"),
    "sys.exit() in build_model": (
        "import sys, torch\ndef build_model():\n    sys.exit(4)\n"
        "def example_inputs(b):\n    return (torch.zeros(b, 2),)\n",
        "sys.exit(4)",
    ),
    "build_model returns a number": (
        "import torch\ndef build_model():\n    return 5\n"
        "def example_inputs(b):\n    return (torch.zeros(b, 2),)\n",
        "returned int, expected a torch.nn.Module",
    ),
    "no example_inputs": (
        "import torch\ndef build_model():\n    return torch.nn.Linear(2, 2)\n",
        "defines no function example_inputs()",
    ),
    "KeyboardInterrupt-free infinite recursion": (
        "import torch\ndef build_model():\n    return build_model()\n"
        "def example_inputs(b):\n    return (torch.zeros(b, 2),)\n",
        "RecursionError",
    ),
}


@pytest.mark.parametrize("name", list(MODEL_FILES))
def test_bad_model_files(name: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text, fragment = MODEL_FILES[name]
    path = tmp_path / f"m_{abs(hash(name))}.py"
    path.write_text(text)
    assert fragment in _one_line(capsys, ["trace", str(path), "--out", str(tmp_path / "p.json")])


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_model_file_that_is_not_a_file(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "model.py"
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    kind = "a FIFO" if kind == "fifo" else "a directory"
    assert f"is {kind}, not a regular file" in _one_line(capsys, ["trace", str(path)])


def test_an_unexpected_error_is_one_line_naming_the_phase(
    profile: Path, tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A bug (here: the planner raising KeyError) is `internal error while planning`, not a traceback."""
    import fxpipe.partitioner

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise KeyError("a bug")

    monkeypatch.setattr(fxpipe.partitioner, "plan_partition", broken)
    err = _one_line(
        capsys, ["plan", str(profile), "--stages", "2", "--out", str(tmp_path / "p.json")]
    )
    assert (
        err.startswith("error: internal error while planning: KeyError: 'a bug'")
        and "rerun with --debug" in err
    )
    with pytest.raises(KeyError):
        main(["--debug", "plan", str(profile), "--stages", "2", "--out", str(tmp_path / "p.json")])


def test_a_closed_stdout_ends_a_verb_quietly(
    profile: Path, tmp_path: Path, monkeypatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import fxpipe.partitioner

    def closed(*args, **kwargs):  # type: ignore[no-untyped-def]
        raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(fxpipe.partitioner, "print_plan_report", closed)
    assert main(["plan", str(profile), "--stages", "2", "--out", str(tmp_path / "p.json")]) == 141
    assert capsys.readouterr().err == ""


def test_an_output_over_its_input_is_refused(
    profile: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``trace model.py --out model.py`` and ``plan p.json --out p.json`` would destroy what they read (#35 item 10b)."""
    model = tmp_path / "model.py"
    model.write_text(Path(MLP).read_text())
    assert "writing it would destroy its input" in _one_line(
        capsys, ["trace", str(model), "--out", str(model)]
    )
    assert model.read_text() == Path(MLP).read_text()
    mine = tmp_path / "profile.json"
    mine.write_bytes(profile.read_bytes())
    assert "writing it would destroy its input" in _one_line(
        capsys, ["plan", str(mine), "--stages", "2", "--out", str(mine)]
    )
    assert mine.read_bytes() == profile.read_bytes()


def test_plan_given_a_model_file_says_which_verb_takes_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = _one_line(capsys, ["plan", MLP, "--stages", "2", "--out", str(tmp_path / "p.json")])
    assert (
        "`fxpipe plan` takes a profile.json" in err
        and "fxpipe partition MODEL.py" in err
        and "JSON" not in err
    )


def test_an_option_of_another_verb_is_one_line_naming_that_verb(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Not argparse's usage dump: ``partition --optimizer adamw`` (partition's --optimizer is the memory model's)."""
    with pytest.raises(SystemExit) as info:
        main(
            [
                "partition",
                MLP,
                "--stages",
                "2",
                "--optimizer",
                "adamw",
                "--out",
                str(tmp_path / "b"),
            ]
        )
    err = capsys.readouterr().err
    assert info.value.code == 2 and len(err.strip().splitlines()) == 1 and "usage:" not in err, err
    assert "`--optimizer adamw` is an option of `fxpipe run`" in err
    with pytest.raises(SystemExit):
        main(["partition", MLP, "--stages", "2", "--lr", "0.1"])
    assert "`--lr` is an option of `fxpipe run`" in capsys.readouterr().err


def test_a_flag_whose_own_parser_refuses_it_is_one_line(
    mlp_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert "--betas wants two numbers like 0.9,0.999, got '0.9'" in _one_line(
        capsys, ["run", str(mlp_copy), "--betas", "0.9"]
    )


def test_paths_that_start_with_a_brace_are_paths(
    mlp_project: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--out '{exp1}'`` and then verify, report and plan of it: never read as JSON text (#35 item 16)."""
    import shutil

    build = tmp_path / "{exp1}"
    shutil.copytree(mlp_project / "build", build)
    shutil.copy(mlp_project / "model.py", tmp_path / "model.py")
    cwd = os.getcwd()
    os.chdir(tmp_path)  # relative paths, as a user types them
    try:
        assert main(["verify", "{exp1}"]) == 0
        assert main(["report", "{exp1}"]) == 0
        assert main(["plan", "{exp1}/profile.json", "--stages", "2", "--out", "{exp2}.json"]) == 0
    finally:
        os.chdir(cwd)
    assert "error" not in capsys.readouterr().err
    assert (tmp_path / "{exp2}.json").is_file()


@pytest.mark.parametrize("verb", ["verify", "report"])
def test_a_closed_standard_output_still_runs_the_verb(verb: str, mlp_copy: Path) -> None:
    """``fxpipe verify build >&-``: the exit code still says the result."""
    import subprocess
    import sys

    from procs import fxpipe_env

    proc = subprocess.run(
        f'"{sys.executable}" -m fxpipe {verb} "{mlp_copy}" >&-',
        shell=True,
        capture_output=False,
        stderr=subprocess.PIPE,
        text=True,
        env=fxpipe_env(),
        timeout=300,
    )
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
