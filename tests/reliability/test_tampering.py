"""Tampered builds: every consumer refuses with one line before a byte of the changed file runs or is read.

Each tampering writes, where it can, code that would create a marker file if it ever ran;
the marker must never appear. Consumers: ``fxpipe verify`` and ``fxpipe run`` (the CLI, in
process: ``run`` must refuse before starting any process), ``load_stage``,
``load_pipeline`` and a rank's own training entry (``fxpipe.runtime.train.loop.train``, which
reads the model file and plan.json itself). Nothing may block: a FIFO in place of a file is
refused, not waited on (an alarm fails the probe instead of hanging the suite).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from fxpipe.cli import main
from fxpipe.codegen import load_pipeline, load_stage
from fxpipe.errors import BuildDirError, FxpipeError

MARKER_CODE = "\nopen({marker!r}, 'w').write('ran')\n"


@pytest.fixture(autouse=True)
def _never_hang() -> Iterator[None]:
    def fail(*_: object) -> None:
        raise TimeoutError("the probe blocked (a FIFO read?)")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, previous)


def _manifest(build: Path) -> dict:
    return json.loads((build / "manifest.json").read_text())


def _set_hash(build: Path, path: str, value: str) -> None:
    """Rewrite the manifest's hash of ``path`` (a stage file) as a build written broken would hold it."""
    data = _manifest(build)
    for stage in data["stages"]:
        for kind in ("source", "weights"):
            if stage[kind] == path:
                stage[f"{kind}_sha256"] = value
    (build / "manifest.json").write_text(json.dumps(data))


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def _rewrite_weights(build: Path, data: bytes) -> None:
    (build / "stage_1.safetensors").write_bytes(data)
    _set_hash(build, "stage_1.safetensors", hashlib.sha256(data).hexdigest())


def _header(obj: object, tail: bytes = b"") -> bytes:
    head = json.dumps(obj).encode()
    return len(head).to_bytes(8, "little") + head + tail


# name -> (tampering of a build copy, given the marker path; the fragment the refusal must contain)
TAMPERINGS: dict[str, tuple[Callable[[Path, Path], None], str]] = {
    "model file runs code": (
        lambda b, m: open(b.parent / "model.py", "a").write(MARKER_CODE.format(marker=str(m))),
        "model file model.py has sha256",
    ),
    "stage source runs code": (
        lambda b, m: open(b / "stage_0.py", "a").write(MARKER_CODE.format(marker=str(m))),
        "stage source stage_0.py has sha256",
    ),
    "plan.json edited": (
        lambda b, m: (b / "plan.json").write_text(
            (b / "plan.json").read_text().replace('"optimal": true', '"optimal": false', 1) + " "
        ),
        "plan plan.json has sha256",
    ),
    "weights byte flipped": (
        lambda b, m: (b / "stage_1.safetensors").write_bytes(
            (b / "stage_1.safetensors").read_bytes()[:-1] + b"\x00"
        ),
        "stage weights stage_1.safetensors has sha256",
    ),
    "weights are a FIFO": (
        lambda b, m: _fifo(b / "stage_1.safetensors"),
        "is a FIFO, not a regular file",
    ),
    "stage source is a FIFO": (
        lambda b, m: _fifo(b / "stage_0.py"),
        "is a FIFO, not a regular file",
    ),
    "model file is a FIFO": (
        lambda b, m: _fifo(b.parent / "model.py"),
        "is a FIFO, not a regular file",
    ),
    "weights are /dev/zero": (
        lambda b, m: (
            (b / "stage_1.safetensors").unlink(),
            (b / "stage_1.safetensors").symlink_to("/dev/zero"),
        ),
        "not a regular file",
    ),
    "weights missing": (lambda b, m: (b / "stage_1.safetensors").unlink(), "is missing"),
    "model file missing": (lambda b, m: (b.parent / "model.py").unlink(), "model file"),
    "weights header missing": (
        lambda b, m: _rewrite_weights(b, b"\x01\x02"),
        "has no safetensors header",
    ),
    "weights header huge": (
        lambda b, m: _rewrite_weights(b, (1 << 62).to_bytes(8, "little") + b"{}"),
        "header claims",
    ),
    "weights header not JSON": (
        lambda b, m: _rewrite_weights(b, (4).to_bytes(8, "little") + b"{{{{"),
        "header is not valid JSON",
    ),
    "weights tensor outside file": (
        lambda b, m: _rewrite_weights(
            b, _header({"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\x00" * 4)
        ),
        "lies outside the file",
    ),
    "weights unknown dtype": (
        lambda b, m: _rewrite_weights(
            b, _header({"w": {"dtype": "F99", "shape": [1], "data_offsets": [0, 4]}}, b"\x00" * 4)
        ),
        "cannot read stage weights",
    ),
    "shared classes run code": (
        lambda b, m: open(b / "shared.py", "a").write(MARKER_CODE.format(marker=str(m))),
        "shared classes shared.py has sha256",
    ),
    "shared classes are a FIFO": (
        lambda b, m: _fifo(b / "shared.py"),
        "is a FIFO, not a regular file",
    ),
    "shared classes missing": (lambda b, m: (b / "shared.py").unlink(), "shared classes"),
    "shared classes path leaves the build": (
        lambda b, m: (b / "manifest.json").write_text(
            (b / "manifest.json")
            .read_text()
            .replace('"shared_source": "shared.py"', '"shared_source": "../model.py"')
        ),
        "is not a file name inside the build directory",
    ),
    "stage source path leaves the build": (
        lambda b, m: (b / "manifest.json").write_text(
            (b / "manifest.json")
            .read_text()
            .replace('"source": "stage_0.py"', '"source": "../model.py"')
        ),
        "is not a file name inside the build directory",
    ),
}

WHO_READS = {  # which consumers read the tampered file (stage 0 and stage 1 both import the model file)
    "plan.json edited": ("run", "train"),
    "stage source runs code": ("verify", "run", "load_stage", "load_pipeline"),
    "stage source is a FIFO": ("verify", "run", "load_stage", "load_pipeline"),
    "stage source path leaves the build": ("verify", "run", "load_stage", "load_pipeline", "train"),
    "shared classes run code": ("verify", "run", "load_stage", "load_pipeline"),
    "shared classes are a FIFO": ("verify", "run", "load_stage", "load_pipeline"),
    "shared classes missing": ("verify", "run", "load_stage", "load_pipeline"),
    "shared classes path leaves the build": (
        "verify",
        "run",
        "load_stage",
        "load_pipeline",
        "train",
    ),
}
WEIGHT_READERS = (
    "verify",
    "load_stage",
    "load_pipeline",
)  # `run` checks weights on the rank that loads them
ALL = ("verify", "run", "load_stage", "load_pipeline", "train")


def _readers(name: str) -> tuple[str, ...]:
    if name in WHO_READS:
        return WHO_READS[name]
    return WEIGHT_READERS if name.startswith("weights") else ALL


def _consume(who: str, build: Path, capsys: pytest.CaptureFixture[str]) -> str:
    """Run consumer ``who`` on ``build``; the one error line it gave."""
    if who in ("verify", "run"):
        assert main([who, str(build), "--steps", "1"] if who == "run" else [who, str(build)]) == 2
        err = capsys.readouterr().err
        assert (
            err.startswith("error: ")
            and len(err.strip().splitlines()) == 1
            and "Traceback" not in err
        ), err
        return err
    with pytest.raises(FxpipeError) as info:
        if who == "load_stage":
            for index in (0, 1):
                load_stage(build, index)
        elif who == "load_pipeline":
            load_pipeline(build)
        else:
            from fxpipe.runtime.train.run_options import RunOptions
            from fxpipe.runtime.train.loop import train

            train(build, RunOptions(steps=1))
    assert "\n" not in str(info.value)
    return str(info.value)


CASES = [(name, who) for name in TAMPERINGS for who in _readers(name)]


@pytest.mark.parametrize(("name", "who"), CASES, ids=[f"{n} / {w}" for n, w in CASES])
def test_tampered_build_is_refused_before_it_runs(
    name: str,
    who: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    request: pytest.FixtureRequest,
) -> None:
    build = request.getfixturevalue("shared_copy" if name.startswith("shared") else "leaf_copy")
    tamper, fragment = TAMPERINGS[name]
    marker = tmp_path / "marker"
    tamper(build, marker)
    message = _consume(who, build, capsys)
    assert fragment in message, message
    assert not marker.exists(), f"{name}: the tampered code ran before {who} refused it"
    assert not (build / "run.json").exists()


def test_the_leaf_build_imports_the_model_file_on_every_stage(leaf_project: Path) -> None:
    """The premise of the probes above: every stage's source runs classes of the model file."""
    assert all(s["imports_model_file"] for s in _manifest(leaf_project / "build")["stages"])


def test_the_shared_build_shares_a_class_between_its_stages(shared_project: Path) -> None:
    """The premise of the shared-classes probes: both stages import ``Block`` from shared.py."""
    manifest = _manifest(shared_project / "build")
    assert manifest["shared_source"] == "shared.py" and all(
        s["imports_shared"] for s in manifest["stages"]
    )
    assert all(
        s["imports_model_file"] for s in manifest["stages"]
    )  # Block holds the model file's Scale
    assert (
        "class Block_2(torch.nn.Module):" in (shared_project / "build" / "shared.py").read_text()
    )  # Block(16, 16)


def test_a_stage_file_imported_by_hand_checks_the_shared_classes(
    shared_copy: Path, tmp_path: Path
) -> None:
    """Outside load_stage (a person's importlib), the stage's own import checks shared.py against the manifest."""
    import importlib.util

    def import_stage() -> None:
        spec = importlib.util.spec_from_file_location(
            f"hand_{tmp_path.name}", shared_copy / "stage_1.py"
        )
        assert spec is not None and spec.loader is not None
        spec.loader.exec_module(importlib.util.module_from_spec(spec))

    import_stage()  # untouched: it imports
    marker = tmp_path / "marker"
    TAMPERINGS["shared classes run code"][0](shared_copy, marker)
    with pytest.raises(BuildDirError, match="shared classes shared.py has sha256"):
        import_stage()
    assert not marker.exists()


@pytest.mark.parametrize("who", ["run", "train"])
def test_a_model_file_no_stage_imports_is_still_checked(
    who: str, mlp_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """examples/mlp.py's stages import nothing from it, but a run trains on its data and loss."""
    assert not any(s["imports_model_file"] for s in _manifest(mlp_copy)["stages"])
    marker = tmp_path / "marker"
    TAMPERINGS["model file runs code"][0](mlp_copy, marker)
    assert "model file model.py has sha256" in _consume(who, mlp_copy, capsys)
    assert not marker.exists()


def test_the_untampered_copy_verifies_and_loads(
    leaf_copy: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The control: the same copy, untouched, is accepted by every consumer that runs in process."""
    assert main(["verify", str(leaf_copy)]) == 0
    assert "OK" in capsys.readouterr().out
    assert len(load_pipeline(leaf_copy).stages) == 2 and load_stage(leaf_copy, 1) is not None


def test_load_checked_bytes_not_the_file_again(
    leaf_copy: Path, tmp_path: Path, monkeypatch
) -> None:
    """What is imported is the bytes that were hashed: a file swapped after the check is never read."""
    from fxpipe.codegen import integrity

    marker = tmp_path / "marker"
    real = integrity.read_checked_file

    def check_then_swap(path, expected, what, *, keep=True):  # type: ignore[no-untyped-def]
        checked = real(path, expected, what, keep=keep)
        if what == "model file":
            Path(path).write_text(Path(path).read_text() + MARKER_CODE.format(marker=str(marker)))
        return checked

    monkeypatch.setattr(integrity, "read_checked_file", check_then_swap)
    assert len(load_pipeline(leaf_copy).stages) == 2
    assert not marker.exists()


def test_weights_swapped_after_the_check_are_refused(leaf_copy: Path, monkeypatch) -> None:
    from fxpipe.codegen import integrity

    real = integrity.check_build

    def check_then_swap(*args, **kwargs):  # type: ignore[no-untyped-def]
        build = real(*args, **kwargs)
        path = leaf_copy / "stage_1.safetensors"
        (leaf_copy / "swap").write_bytes(path.read_bytes())
        os.replace(leaf_copy / "swap", path)  # the same bytes, in another file
        return build

    monkeypatch.setattr("fxpipe.codegen.load.check_build", check_then_swap)
    with pytest.raises(BuildDirError, match="changed while it was being loaded"):
        load_stage(leaf_copy, 1)


def test_a_build_of_another_torch_release_is_used_with_a_warning(mlp_copy: Path) -> None:
    """The manifest records the torch that built it; another release gets one warning, the same none (#35 item 16)."""
    import warnings

    from fxpipe.codegen.integrity import TorchVersionWarning, check_build

    with warnings.catch_warnings():
        warnings.simplefilter("error", TorchVersionWarning)
        check_build(mlp_copy)  # built by this torch: no warning
    data = json.loads((mlp_copy / "manifest.json").read_text())
    data["torch_version"] = "1.13.1+cu117"
    (mlp_copy / "manifest.json").write_text(json.dumps(data))
    with pytest.warns(TorchVersionWarning, match=r"was built with torch 1\.13\.1, this is torch"):
        load_stage(mlp_copy, 0)
