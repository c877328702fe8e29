"""load_stage: hash checks before any code runs, clear errors, and memory of about one stage."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from codegen_support import example_build  # noqa: F401 (fixture)

from fxpipe.codegen import load_stage, read_manifest
from fxpipe.errors import BuildDirError


@pytest.fixture
def mlp_build(example_build):
    return example_build("mlp", 3, solver="uniform")


def test_load_stage_builds_only_its_stage(mlp_build) -> None:
    manifest, source, out = mlp_build
    stage = load_stage(out, 1)
    assert type(stage).__name__ == "Stage1"
    assert set(stage.state_dict()) == set(manifest.stages[1].parameters + manifest.stages[1].buffers)
    assert all(p.device.type == "cpu" and not p.is_meta for p in stage.parameters())
    x = torch.randn(5, *manifest.stages[1].inputs[0].shape[1:])
    (y,) = stage(x)
    assert y.shape[0] == 5


def test_tampered_source_is_refused_before_it_runs(mlp_build, tmp_path: Path) -> None:
    _, _, out = mlp_build
    marker = tmp_path / "marker"
    with open(out / "stage_2.py", "a") as f:
        f.write(f"\nopen({str(marker)!r}, 'w').write('ran')\n")
    with pytest.raises(BuildDirError, match="stage_2.py has sha256"):
        load_stage(out, 2)
    assert not marker.exists()


def test_tampered_weights_are_refused(mlp_build) -> None:
    _, _, out = mlp_build
    data = bytearray((out / "stage_0.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (out / "stage_0.safetensors").write_bytes(bytes(data))
    with pytest.raises(BuildDirError, match="stage_0.safetensors has sha256"):
        load_stage(out, 0)


def test_missing_files_schema_and_index(mlp_build, tmp_path: Path) -> None:
    manifest, _, out = mlp_build
    with pytest.raises(BuildDirError, match="out of range.*3 stages"):
        load_stage(out, 3)
    (out / "stage_1.safetensors").unlink()
    with pytest.raises(BuildDirError, match="missing"):
        load_stage(out, 1)
    data = json.loads((out / "manifest.json").read_text())
    data["schema_version"] = 99
    (out / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(BuildDirError, match="schema version 99"):
        read_manifest(out)
    with pytest.raises(BuildDirError, match="does not exist"):
        load_stage(tmp_path / "nowhere", 0)


BIG_MLP = '''
import torch
import torch.nn as nn

WIDTH, LAYERS = 2048, 16   # 16 x 16.8 MB = 268 MB of fp32 weights


def build_model():
    return nn.Sequential(*(nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()) for _ in range(LAYERS)))


def example_inputs(batch_size):
    return (torch.randn(batch_size, WIDTH),)
'''

# Peak RSS growth in KiB. VmHWM is the peak RSS of this process image; getrusage's ru_maxrss would
# also carry the (large) pytest parent's peak across fork+exec on Linux.
MEASURE = '''
import sys
import torch
from fxpipe.codegen import load_stage
from fxpipe.modelfile import load_model_file

def status_kib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1])

before = status_kib("VmRSS")
if sys.argv[1] == "model":
    model = load_model_file(sys.argv[2]).build_model()
else:
    stage = load_stage(sys.argv[2], int(sys.argv[3]))
    sum(float(t.sum()) for t in stage.state_dict().values())  # safetensors maps lazily: really read the weights
print(status_kib("VmHWM") - before)
'''


def _peak_kib(*args: str) -> int:
    out = subprocess.run([sys.executable, "-c", MEASURE, *args], capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_last_stage_loads_in_well_under_half_the_memory(tmp_path: Path) -> None:
    from fxpipe.codegen import write_build_dir
    from fxpipe.modelfile import load_model_file
    from fxpipe.partitioner import plan_partition
    from fxpipe.tracer import trace_model_file

    path = tmp_path / "big_mlp.py"
    path.write_text(textwrap.dedent(BIG_MLP))
    source = load_model_file(path)
    traced = trace_model_file(source, 1, progress=False)
    plan = plan_partition(traced.profile, 4, solver="uniform")
    write_build_dir(traced, plan, tmp_path / "build", source, batch_size=1, microbatches=1)
    del traced
    whole = _peak_kib("model", str(path))
    last = _peak_kib("stage", str(tmp_path / "build"), "3")
    assert whole > 200 * 1024, whole  # sanity: the model really is hundreds of MB
    assert last < 0.4 * whole, (last, whole)
