"""The planner at a sequence length or over a distribution of lengths (#36, Note [pricing at a
length]): a profile traced at one length, re-priced at another, against a trace made there.

The model has two attention blocks (FLOPs quadratic in the length) and two wide MLP blocks
(linear): at short lengths the MLPs are the heavy half, at long ones the attention, so the best
2-stage split moves with the length.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from rich.console import Console

from fxpipe.cli import main
from fxpipe.errors import ConfigError, PartitionError
from fxpipe.partitioner import PartitionPlan, plan_partition
from fxpipe.partitioner.report.terminal import print_plan_report
from fxpipe.partitioner.seqlen import (
    lengths_for,
    parse_seq_len,
    price_over,
    read_histogram,
    reprice,
)
from fxpipe.tracer import trace_model
from fxpipe.tracer.profile import ModelProfile, PricedAt

TRACED = 32
RTOL = 1e-6  # the analytic profile's costs are polynomials the fit holds exactly: float noise only


class Attention(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, -1)
        scores = torch.softmax(q @ k.transpose(-1, -2) / 8.0, -1)
        return x + self.o(scores @ v)


class MLP(nn.Module):
    def __init__(self, d: int, hidden: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(d, hidden), nn.Linear(hidden, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Net(nn.Module):
    def __init__(self, d: int = 32, hidden: int = 512) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, d)
        self.blocks = nn.Sequential(Attention(d), Attention(d), MLP(d, hidden), MLP(d, hidden))
        self.head = nn.Linear(d, 50)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.emb(idx)))


_TRACES: dict[int, ModelProfile] = {}


def _trace(length: int) -> ModelProfile:
    """The profile traced at ``length`` (once per length in this module)."""
    if length not in _TRACES:
        torch.manual_seed(0)
        idx = torch.randint(0, 50, (2, length), generator=torch.Generator().manual_seed(length))
        dims = {"idx": {1: ("seq", 2, 4096)}}
        _TRACES[length] = trace_model(Net(), (idx,), dynamic_dims=dims, progress=False).profile
    return _TRACES[length]


@pytest.fixture(scope="module")
def traced() -> ModelProfile:
    return _trace(TRACED)


def _split(profile: ModelProfile) -> list[tuple[str, ...]]:
    return [s.units for s in plan_partition(profile, 2, microbatches=2).stages]


def _close(a: float, b: float) -> bool:
    return abs(a - b) <= RTOL * max(abs(a), abs(b), 1e-12)


@pytest.mark.parametrize("factor", [2, 16])
def test_repriced_costs_match_a_trace_at_that_length(traced: ModelProfile, factor: int) -> None:
    length = factor * TRACED
    repriced, there = reprice(traced, {"seq": length}), _trace(length)
    assert len(repriced.units) == len(there.units)
    for mine, want in zip(repriced.units, there.units):
        assert mine.name == want.name
        for field in ("fwd_ms", "bwd_ms", "fwd_flops", "bwd_weight_ms"):
            assert _close(getattr(mine, field), getattr(want, field)), (mine.name, field)
        assert mine.activation_bytes == want.activation_bytes, mine.name
        assert [o.shape for o in mine.outputs] == [o.shape for o in want.outputs], mine.name
    assert [e.bytes for e in repriced.edges] == [e.bytes for e in there.edges]
    assert [t.shape for t in repriced.inputs] == [t.shape for t in there.inputs]
    assert repriced.priced_at == (PricedAt(sizes={"seq": length}),)


def test_attention_flops_are_fitted_quadratic_the_mlp_linear(traced: ModelProfile) -> None:
    by_name = {u.name: u for u in traced.units}
    attention, mlp = by_name["blocks.0"].scaling, by_name["blocks.2.up"].scaling
    assert attention is not None and mlp is not None
    assert attention.fwd_flops.get("seq*seq", 0) > 0  # q @ k.T and scores @ v
    assert "seq*seq" not in mlp.fwd_flops and mlp.fwd_flops["seq"] > 0
    at_8x = reprice(traced, {"seq": 8 * TRACED})
    ratio = {u.name: u.fwd_flops / by_name[u.name].fwd_flops for u in at_8x.units if u.fwd_flops}
    assert ratio["blocks.2.up"] == pytest.approx(8) and ratio["blocks.0"] > 8 * 4


def test_the_plan_follows_the_length_as_a_trace_there_would(traced: ModelProfile) -> None:
    short, long = _split(reprice(traced, {"seq": 64})), _split(reprice(traced, {"seq": 512}))
    assert short != long  # the heavy half moves from the MLPs to the attention
    assert short == _split(_trace(64)) and long == _split(_trace(512))  # as traced there


def test_the_expected_step_averages_times_and_keeps_the_longest_memory(
    traced: ModelProfile,
) -> None:
    points = lengths_for(traced, parse_seq_len("64:3,512:1"))
    assert [(p.sizes, p.weight) for p in points] == [({"seq": 64}, 0.75), ({"seq": 512}, 0.25)]
    mixed = price_over(traced, points)
    short, long = reprice(traced, {"seq": 64}), reprice(traced, {"seq": 512})
    for m, s, lg in zip(mixed.units, short.units, long.units):
        assert _close(m.fwd_ms, 0.75 * s.fwd_ms + 0.25 * lg.fwd_ms)
        assert _close(m.bwd_ms, 0.75 * s.bwd_ms + 0.25 * lg.bwd_ms)
        assert _close(m.bwd_weight_ms, 0.75 * s.bwd_weight_ms + 0.25 * lg.bwd_weight_ms)
        assert m.activation_bytes == lg.activation_bytes and m.outputs == lg.outputs
    plan = plan_partition(mixed, 2, microbatches=2)
    assert plan.priced_at == points
    assert PartitionPlan.from_json(plan.to_json()).priced_at == points  # round-trips
    console = Console(record=True, width=400)
    print_plan_report(plan, mixed, console=console)
    assert "priced at the expected step over seq = 64 (75%), seq = 512 (25%)" in (
        console.export_text()
    )


def test_lengths_outside_the_range_or_without_dynamic_dims_are_refused(
    traced: ModelProfile,
) -> None:
    with pytest.raises(PartitionError, match="seq = 8192 is outside the range 2..4096"):
        lengths_for(traced, parse_seq_len("8192"))
    with pytest.raises(PartitionError, match="names \\['tgt'\\]"):
        lengths_for(traced, parse_seq_len("tgt=64"))
    with pytest.raises(PartitionError, match="no dynamic dimension besides the batch"):
        lengths_for(dataclasses.replace(traced, dynamic=()), parse_seq_len("64"))
    for bad in ("x", "0", "64:-1", "64:0", "seq=x"):
        with pytest.raises(ConfigError):
            parse_seq_len(bad)
    with pytest.raises(PartitionError, match="distribution"):
        reprice(price_over(traced, lengths_for(traced, parse_seq_len("64,128"))), {"seq": 32})


def test_histogram_files_text_and_json(tmp_path: Path) -> None:
    text = tmp_path / "lengths.txt"
    text.write_text("# length count\n128 30\n512, 10\n128 10\n")
    assert read_histogram(str(text)) == ((None, 128, 0.8), (None, 512, 0.2))
    js = tmp_path / "lengths.json"
    js.write_text(json.dumps({"256": 1, "64": 3}))
    assert read_histogram(str(js)) == ((None, 64, 0.75), (None, 256, 0.25))
    (tmp_path / "bad.txt").write_text("128 1 2\n")
    with pytest.raises(ConfigError, match="line 1: write LENGTH WEIGHT"):
        read_histogram(str(tmp_path / "bad.txt"))


def test_fxpipe_plan_at_a_length_and_over_a_histogram(
    traced: ModelProfile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    traced.to_json(profile)
    out = tmp_path / "plan.json"
    assert main(["plan", str(profile), "--stages", "2", "--seq-len", "512", "--out", str(out)]) == 0
    plan = PartitionPlan.from_json(out)
    assert plan.priced_at == (PricedAt(sizes={"seq": 512}),)
    assert [s.units for s in plan.stages] == _split(reprice(traced, {"seq": 512}))
    assert "priced at seq = 512 (the build runs 2..4096)" in " ".join(
        capsys.readouterr().out.split()
    )
    histogram = tmp_path / "lengths.txt"
    histogram.write_text("64 3\n512 1\n")
    args = ["plan", str(profile), "--stages", "2", "--seq-len-histogram", str(histogram)]
    assert main([*args, "--out", str(out)]) == 0
    assert [p.weight for p in PartitionPlan.from_json(out).priced_at] == [0.75, 0.25]
    assert main([*args, "--seq-len", "64", "--out", str(out)]) != 0
    assert "give --seq-len or --seq-len-histogram, not both" in capsys.readouterr().err


def test_fxpipe_partition_at_a_length_writes_the_priced_plan_and_profile(tmp_path: Path) -> None:
    model = Path(__file__).resolve().parents[1] / "runtime" / "varlen_llama.py"  # seq 2..64, at 16
    out = tmp_path / "build"
    args = ["partition", str(model), "--stages", "2", "--seq-len", "48", "--no-check"]
    assert main([*args, "--out", str(out)]) == 0
    at_48 = (PricedAt(sizes={"seq": 48}),)
    assert PartitionPlan.from_json(out / "plan.json").priced_at == at_48
    profile = ModelProfile.from_json(out / "profile.json")
    assert profile.priced_at == at_48 and profile.inputs[0].shape[1] == 48
    assert "priced at seq = 48 (the build runs 2..64)" in (out / "report.html").read_text()


def _ranked(path: Path) -> list[tuple[dict, float, int]]:
    found = json.loads(path.read_text())["ranked"]
    return [(r["config"], r["step_ms"], r["peak_memory_bytes"]) for r in found]


def test_the_cluster_search_prices_at_the_length(
    traced: ModelProfile, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``fxpipe plan --devices N --seq-len L`` searches the configurations (stages, replicas,
    microbatch sizes, sharding) on the profile priced at ``L``: the same ranking, step times and
    memory as the search on a trace made at ``L``, and not those of the traced length."""
    at_32, at_512 = tmp_path / "at_32.json", tmp_path / "at_512.json"
    traced.to_json(at_32)
    _trace(512).to_json(at_512)
    search = ["--devices", "4", "--global-batch", "8"]
    printed = {}
    for profile, extra, out in [
        (at_32, ["--seq-len", "512"], "priced"),
        (at_512, [], "traced"),
        (at_32, [], "short"),
    ]:
        args = ["plan", str(profile), *extra, *search, "--out", str(tmp_path / f"{out}.json")]
        assert main(args) == 0
        printed[out] = " ".join(capsys.readouterr().out.split())
    priced, there = (
        _ranked(tmp_path / "priced.search.json"),
        _ranked(tmp_path / "traced.search.json"),
    )
    assert [r[0] for r in priced] == [r[0] for r in there]
    assert all(_close(a[1], b[1]) and a[2] == b[2] for a, b in zip(priced, there))
    short = _ranked(tmp_path / "short.search.json")
    assert all(not _close(a[1], b[1]) for a, b in zip(priced, short))
    plan = PartitionPlan.from_json(tmp_path / "priced.json")
    assert plan.priced_at == (PricedAt(sizes={"seq": 512}),)
    assert "configurations priced at seq = 512" in printed["priced"]
    assert "configurations priced at seq = 32" in printed["short"]


def test_fxpipe_partition_with_devices_at_a_length(tmp_path: Path) -> None:
    """The search's chosen microbatch size is traced again and priced at the length too."""
    model = Path(__file__).resolve().parents[1] / "runtime" / "varlen_llama.py"  # seq 2..64, at 16
    out = tmp_path / "build"
    args = ["partition", str(model), "--devices", "2", "--global-batch", "4", "--seq-len", "48"]
    assert main([*args, "--no-check", "--out", str(out)]) == 0
    at_48 = (PricedAt(sizes={"seq": 48}),)
    assert PartitionPlan.from_json(out / "plan.json").priced_at == at_48
    profile = ModelProfile.from_json(out / "profile.json")
    assert profile.priced_at == at_48 and profile.inputs[0].shape[1] == 48
