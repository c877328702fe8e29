"""The cost model's constants come from one data file, each with its provenance (Note [calibration data])."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from dataclasses import fields
from importlib import resources
from pathlib import Path

import pytest

from fxpipe.calibration_data import (
    CALIBRATION_FILE,
    Constant,
    _check,
    all_constants,
    constants,
    hosts,
    names,
    values,
)
from fxpipe.errors import ConfigError
from fxpipe.partitioner.cost import LINK_PRESETS
from fxpipe.partitioner.prediction import RUNTIME_COSTS, RuntimeCosts
from fxpipe.tracer.measure.calibration import CPU_CALL_MS, DEVICE_PRESETS

ROOT = Path(__file__).resolve().parents[1]


def _leaves(group: dict, path: str):
    for key, entry in group.items():
        if "value" in entry:
            yield f"{path}.{key}", entry
        else:
            yield from _leaves(entry, f"{path}.{key}")


def test_every_entry_has_a_value_a_unit_and_provenance():
    raw = json.loads(
        resources.files("fxpipe").joinpath(CALIBRATION_FILE).read_text(encoding="utf-8")
    )
    leaves = [
        leaf
        for section in ("device_presets", "runtime_costs", "links")
        for name, group in raw[section].items()
        for leaf in _leaves(group, f"{section}.{name}")
    ]
    assert len(leaves) == len(list(all_constants())) > 50
    for path, entry in leaves:
        assert isinstance(entry["value"], (bool, int, float)), path
        assert entry["unit"], path
        prov = entry["provenance"]
        assert set(prov) == {"benchmark", "host", "date", "how"}, path
        assert all(isinstance(v, str) and v for v in prov.values()), path
        assert prov["host"] in raw["hosts"], path
        assert prov["date"] == "unknown" or (len(prov["date"]) == 10 and prov["date"][4] == "-"), (
            path
        )
        script = prov["benchmark"]
        if script.startswith("benchmarks/") and script.endswith(".py"):
            assert (ROOT / script).is_file(), f"{path} names {script}, which does not exist"


def test_the_presets_are_the_files_values():
    for name in names("runtime_costs"):
        figures = values("runtime_costs", name)
        preset = RUNTIME_COSTS[name]
        for f in fields(RuntimeCosts):
            if f.name in figures:
                got, want = getattr(preset, f.name), figures[f.name]
                assert got == want and type(got) is type(want), (name, f.name)
    for name in names("device_presets"):
        figures = values("device_presets", name)
        preset = DEVICE_PRESETS[name]
        assert preset.op_extra_s == tuple(figures.pop("op_extra_s", {}).items())
        assert all(getattr(preset, k) == v for k, v in figures.items())
    assert set(LINK_PRESETS) == set(names("links"))


def test_spot_values():
    # literals as they stood in the code before they moved to the data file
    cpu, cuda = RUNTIME_COSTS["cpu"], RUNTIME_COSTS["cuda"]
    assert (cpu.action_ms, cpu.message_ms, cpu.message_stall_ms, cpu.split_factor) == (
        0.04,
        0.06,
        0.36,
        1.33,
    )
    assert (cpu.dp_sync_ms, cpu.dp_sync_tensor_ms, cpu.recompute_fwd_saved_ms) == (
        1.0,
        0.035,
        0.0075,
    )
    assert cpu.oversubscribed_rate == 0.9 and cpu.step_receives is True and cpu.workspace_bytes == 0
    assert (
        cuda.workspace_bytes == 64 * 2**20 and cuda.message_ms == 0.03 and cuda.split_factor == 1.0
    )
    assert cuda.optimizer_bytes_per_s == 1e12 and cuda.step_receives is False
    assert RuntimeCosts(**values("runtime_costs", "cpu")) == cpu
    c = DEVICE_PRESETS["cpu"]
    assert (c.flops_per_s, c.bytes_per_s, c.op_overhead_s, c.bwd_op_overhead_s, c.cold_factor) == (
        75e9,
        20e9,
        3.0e-6,
        2.8e-6,
        1.45,
    )
    assert c.op_extra_s == (
        ("convolution", 40e-6),
        ("convolution_backward", 90e-6),
        ("native_batch_norm", 10e-6),
        ("native_batch_norm_backward", 3e-6),
    )
    assert c.call_ms == CPU_CALL_MS == 0.034
    g = DEVICE_PRESETS["cuda"]
    assert (g.flops_per_s, g.bytes_per_s, g.op_overhead_s, g.async_launch, g.call_ms) == (
        50e12,
        2.5e12,
        15e-6,
        True,
        None,
    )
    assert LINK_PRESETS["loopback"] == (4.4e9, 100e-6) and LINK_PRESETS["nvlink"] == (200e9, 10e-6)


def test_provenance_reads_back():
    stall = constants("runtime_costs", "cpu")["message_stall_ms"]
    assert isinstance(stall, Constant) and stall.value == 0.36
    assert stall.provenance.benchmark == "benchmarks/prediction/gloo_stalls.py"
    assert stall.provenance.host in hosts() and stall.provenance.date == "2026-11-26"
    conv = constants("device_presets", "cpu")["op_extra_s"]["convolution"]
    assert isinstance(conv, Constant) and conv.unit.startswith("s per call")


def test_a_malformed_entry_is_refused():
    known = {"cpu-vm": "a host"}
    good = {
        "value": 1.0,
        "unit": "ms",
        "provenance": {"benchmark": "none", "host": "cpu-vm", "date": "unknown", "how": "assumed"},
    }
    _check({"x": good, "group": {"y": good}}, "runtime_costs.cpu", known)
    with pytest.raises(ConfigError, match="runtime_costs.cpu.x lacks how"):
        _check(
            {"x": {**good, "provenance": {**good["provenance"], "how": ""}}},
            "runtime_costs.cpu",
            known,
        )
    with pytest.raises(ConfigError, match="names host 'elsewhere'"):
        _check(
            {"x": {**good, "provenance": {**good["provenance"], "host": "elsewhere"}}},
            "runtime_costs.cpu",
            known,
        )
    with pytest.raises(ConfigError, match="no runtime_costs entry 'tpu'"):
        constants("runtime_costs", "tpu")


def test_the_loader_imports_no_torch_and_ships_with_the_package():
    code = "import sys, fxpipe.calibration_data as c; list(c.all_constants()); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    assert CALIBRATION_FILE in pyproject["tool"]["setuptools"]["package-data"]["fxpipe"]
