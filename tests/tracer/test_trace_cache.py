"""The trace cache (Note [the trace cache] in ``fxpipe.tracer.trace_cache``): ``fxpipe partition``
of a model traced before at another stage count reads the trace back instead of tracing and
counting again, and writes the build a fresh trace writes; an edited model file, or a helper it
imports from its folder, misses."""

from __future__ import annotations

import json
import os
import shutil
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fxpipe.cli import main
from fxpipe.modelfile import load_model_file
from fxpipe.tracer.trace_cache import trace_key

ROOT = Path(__file__).resolve().parents[2]
LLAMA = ROOT / "tests" / "zoo" / "models" / "llama.py"
MLP = ROOT / "examples" / "mlp.py"
DICT_BATCH = ROOT / "tests" / "zoo" / "models" / "dict_batch.py"


def _partition(
    capsys: pytest.CaptureFixture[str], model: Path, out: Path, stages: int, *extra: str
) -> str:
    capsys.readouterr()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        code = main(
            ["partition", str(model), "--stages", str(stages), "--solver", "dp", "--out", str(out)]
            + list(extra)
        )
    captured = capsys.readouterr()
    assert code == 0, captured.err
    return captured.out


def _json(path: Path, *drop: str) -> object:
    """A build's JSON file less the fields that differ between any two builds (a solve's seconds,
    the hashes of safetensors files, whose header's key order safetensors does not fix)."""

    def clean(value: object) -> object:
        if isinstance(value, dict):
            return {k: clean(v) for k, v in value.items() if k not in drop}
        if isinstance(value, list):
            return [clean(v) for v in value]
        return value

    return clean(json.loads(path.read_text()))


@pytest.mark.parametrize(
    "model",
    [LLAMA, DICT_BATCH],  # a transformers Llama (make test-heavy); a dict batch through export
    ids=["llama", "dict_batch"],
)
def test_another_stage_count_reads_the_trace_and_builds_what_a_fresh_trace_builds(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], model: Path
) -> None:
    """Export's graphs: fake tensors with a symbolic batch, views sharing storages."""
    export = ("--frontend", "export")
    first = _partition(capsys, model, tmp_path / "two", 2, "--no-check", *export)
    assert "fxpipe: trace (export" in first and "fxpipe: count" in first
    assert len(list((Path(os.environ["FXPIPE_CACHE_DIR"]) / "traces").glob("*.pt"))) == 1
    cached = _partition(capsys, model, tmp_path / "four", 4, *export)
    assert "fxpipe: trace: cached (export" in cached
    assert "fxpipe: trace (" not in cached and "fxpipe: count" not in cached
    assert "fxpipe: check" in cached  # the stages were run against the model: they verify
    fresh = _partition(
        capsys, model, tmp_path / "fresh", 4, "--no-trace-cache", "--no-check", *export
    )
    assert "fxpipe: trace (export" in fresh
    a, b = tmp_path / "four", tmp_path / "fresh"
    assert sorted(p.name for p in a.iterdir()) == sorted(p.name for p in b.iterdir())
    assert _json(a / "plan.json", "solve_seconds") == _json(b / "plan.json", "solve_seconds")
    assert (a / "profile.json").read_text() == (b / "profile.json").read_text()
    drop = ("weights_sha256", "plan_sha256")
    assert _json(a / "manifest.json", *drop) == _json(b / "manifest.json", *drop)
    for path in sorted(a.glob("*.py")):
        assert path.read_text() == (b / path.name).read_text(), path.name
    for path in sorted(a.glob("stage_*.safetensors")):
        got, want = load_file(str(path)), load_file(str(b / path.name))
        assert got.keys() == want.keys()
        for key in got:
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=0, msg=key)


def test_an_edited_model_file_misses_and_an_unchanged_one_hits(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = tmp_path / "mlp.py"
    shutil.copy(MLP, model)
    assert "fxpipe: trace (symbolic" in _partition(capsys, model, tmp_path / "a", 2)
    assert "fxpipe: trace: cached (symbolic" in _partition(capsys, model, tmp_path / "b", 4)
    model.write_text(model.read_text().replace("HIDDEN = 64", "HIDDEN = 48"))
    edited = _partition(capsys, model, tmp_path / "c", 4)
    assert "fxpipe: trace (symbolic" in edited and "cached" not in edited
    assert json.loads((tmp_path / "c" / "profile.json").read_text())["param_shapes"][
        "layers.0.0.weight"
    ] == [48, 32]
    other = tmp_path / "elsewhere"
    other.mkdir()
    out = _partition(capsys, model, tmp_path / "d", 2, "--trace-cache", str(other))
    assert "cached" not in out and list(other.glob("traces/*.pt"))  # --trace-cache names the folder


def test_the_key_follows_a_helper_beside_the_model_file_and_the_options(tmp_path: Path) -> None:
    (tmp_path / "helper_m37.py").write_text("WIDTH = 8\n")
    model = tmp_path / "model.py"
    model.write_text(
        "import sys, torch\n"
        f"sys.path.insert(0, {str(tmp_path)!r})\n"
        "import helper_m37\n"
        "def build_model():\n"
        "    return torch.nn.Linear(helper_m37.WIDTH, 2)\n"
        "def example_inputs(batch_size):\n"
        "    return (torch.ones(batch_size, helper_m37.WIDTH),)\n"
    )
    try:
        source = load_model_file(model)
        inputs = source.example_call(2)
        key = trace_key(source, 2, inputs, {"frontend": "auto"})
        assert trace_key(source, 2, inputs, {"frontend": "auto"}) == key
        assert trace_key(source, 4, source.example_call(4), {"frontend": "auto"}) != key
        assert trace_key(source, 2, inputs, {"frontend": "symbolic"}) != key
        (tmp_path / "helper_m37.py").write_text("WIDTH = 8  # edited\n")
        assert trace_key(source, 2, inputs, {"frontend": "auto"}) != key
    finally:
        sys.modules.pop("helper_m37", None)


def test_the_key_draws_nothing_the_model_build_sees(tmp_path: Path) -> None:
    """An example_inputs that draws from the global RNG (the contract asks for seeded generators)
    is called once more for the key: the model built next still gets the weights it gets
    without a cache, on a miss and on a hit."""
    from fxpipe.tracer.trace_cache import trace_cached

    model = tmp_path / "unseeded.py"
    model.write_text(
        "import torch\n"
        "def build_model():\n"
        "    return torch.nn.Linear(4, 2)\n"
        "def example_inputs(batch_size):\n"
        "    return (torch.randn(batch_size, 4),)\n"
    )
    source = load_model_file(model)
    weights = []
    for cache in (None, tmp_path / "cache", tmp_path / "cache"):  # none, a miss, a hit
        torch.manual_seed(0)
        traced = trace_cached(source, 2, cache, progress=False)
        weights.append(traced.model.weight.detach().clone())
    assert list((tmp_path / "cache" / "traces").glob("*.pt"))
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=0)
    torch.testing.assert_close(weights[2], weights[0], rtol=0, atol=0)


def _linear_model(tmp_path: Path) -> Path:
    model = tmp_path / "linear.py"
    model.write_text(
        "import torch\n"
        "def build_model():\n"
        "    torch.manual_seed(0)\n"
        "    return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2))\n"
        "def example_inputs(batch_size):\n"
        "    return (torch.ones(batch_size, 4),)\n"
    )
    return model


def test_a_budget_evicts_the_least_recently_used_trace_and_keeps_the_one_just_hit(
    tmp_path: Path,
) -> None:
    """Note [the trace cache's budget]: a hit marks its entry as used; a write over the budget
    removes the entries used longest ago, says so in one progress line, and keeps the rest."""
    import io

    from fxpipe.tracer.progress import reporting
    from fxpipe.tracer.trace_cache import trace_cached

    source = load_model_file(_linear_model(tmp_path))
    cache = tmp_path / "cache"
    traces = cache / "traces"

    def trace(batch_size: int, budget: int = 2**30) -> str:
        lines = io.StringIO()
        with reporting(lines, terminal=False):
            trace_cached(source, batch_size, cache, budget=budget, progress=False)
        return lines.getvalue()

    trace(2)
    (a,) = traces.glob("*.pt")
    trace(3)
    (b,) = set(traces.glob("*.pt")) - {a}
    old = a.stat().st_mtime - 1000
    os.utime(a, (old, old))  # a was written first, b next ...
    os.utime(b, (old + 10, old + 10))
    assert "trace: cached" in trace(2)  # ... and a was read since: a is the recently used one
    assert a.stat().st_mtime > old + 10
    size_a, size_b = a.stat().st_size, b.stat().st_size
    out = trace(4, budget=size_a + size_b + size_b // 2)  # room for two entries of three
    (c,) = set(traces.glob("*.pt")) - {a, b}
    assert a.exists() and c.exists() and not b.exists()
    assert "fxpipe: trace cache: removed 1 least recently used trace (" in out
    assert out.count("trace cache:") == 1
    assert "trace cache:" not in trace(4)  # a hit writes nothing and removes nothing


def test_trace_cache_gib_is_the_budget_of_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from fxpipe.errors import ConfigError
    from fxpipe.tracer.trace_options import ModelTraceOptions

    assert ModelTraceOptions().cache_budget() == 2 * 2**30
    with pytest.raises(ConfigError, match="--trace-cache-gib 0 is not a positive number"):
        ModelTraceOptions(trace_cache_gib=0)
    model, cache = _linear_model(tmp_path), tmp_path / "cache"
    for batch_size in (2, 3):
        capsys.readouterr()
        argv = ["trace", str(model), "--batch-size", str(batch_size), "--trace-cache", str(cache)]
        argv += ["--trace-cache-gib", "1e-9", "--out", str(tmp_path / f"p{batch_size}.json")]
        assert main(argv) == 0
    assert "fxpipe: trace cache: removed 1 least recently used trace" in capsys.readouterr().out
    assert len(list((cache / "traces").glob("*.pt"))) == 1  # the one just written is kept


def test_pruning_tolerates_files_vanishing_and_removes_a_killed_writers_temporary_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another partition may prune the same folder at the same time: an entry removed under
    this one is no error; a ``.tmp-`` file an hour old was left by a killed writer, a fresh one is
    a live writer's."""
    import time

    from fxpipe.tracer import trace_cache_prune
    from fxpipe.tracer.trace_cache_prune import STALE_TEMP_SECONDS, prune

    now = time.time()
    for i, name in enumerate(["old.pt", "older.pt", "new.pt", ".tmp-dead.pt", ".tmp-live.pt"]):
        (tmp_path / name).write_bytes(b"x" * 100)
    for name, age in [("older.pt", 300), ("old.pt", 200), ("new.pt", 0)]:
        os.utime(tmp_path / name, (now - age, now - age))
    dead = now - STALE_TEMP_SECONDS - 60
    os.utime(tmp_path / ".tmp-dead.pt", (dead, dead))
    real_unlink, real_scandir = os.unlink, os.scandir

    def raced(path: str | os.PathLike[str]) -> None:
        if str(path).endswith("older.pt"):
            real_unlink(path)  # another process removed it first
        real_unlink(path)

    monkeypatch.setattr(trace_cache_prune.os, "unlink", raced)
    pruned = prune(tmp_path, budget=100, keep="new.pt", now=now)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-live.pt", "new.pt"]
    assert (pruned.evicted, pruned.kept, pruned.stale) == (1, 100, 1)  # older.pt was not ours
    line = pruned.line(100)
    assert line is not None and "removed 1 least recently used trace" in line
    assert "1 temporary file" in line

    def listed_then_gone(folder: Path) -> list[os.DirEntry[str]]:
        entries = list(real_scandir(folder))
        real_unlink(folder / "new.pt")  # between the listing and its stat
        return entries

    monkeypatch.setattr(trace_cache_prune.os, "scandir", listed_then_gone)
    assert prune(tmp_path, budget=0, now=now).evicted == 0
    assert prune(tmp_path / "absent", budget=0) == trace_cache_prune.Pruned()


def test_a_cached_trace_shows_the_warnings_the_first_trace_showed(tmp_path: Path) -> None:
    """The GPT example's attention is kept whole with a warning at the user's line; a hit shows
    the same warning (text, category, file and line) once, as the first trace did."""
    from example_models import EXAMPLES

    from fxpipe.tracer.trace_cache import trace_cached

    source = load_model_file(EXAMPLES["gpt"])
    shown = []
    for _ in range(2):  # a miss, then a hit
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trace_cached(source, 2, tmp_path / "cache", frontend="symbolic", progress=False)
        shown.append(
            [
                (str(w.message), w.category, w.filename, w.lineno)
                for w in caught
                if str(w.message).startswith("fxpipe:")
            ]
        )
    assert len(list((tmp_path / "cache" / "traces").glob("*.pt"))) == 1
    first, cached = shown
    assert any("symbolic tracing failed inside" in text for text, *_ in first)
    assert cached == first
    assert first[0][2] == str(EXAMPLES["gpt"])  # the user's line, not fxpipe's
