"""The tensor-parallel rules (Note [tensor-parallel rules] in fxpipe.codegen.tp_plan) on tiny modules."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.tp_plan import TensorParallelPlan, find_stage_plan


class SwiGLU(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = nn.Linear(8, 16)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Attention(nn.Module):
    """4 query heads, 2 KV heads of size 2, literal sizes as the emitter writes them."""

    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 4)
        self.v = nn.Linear(8, 4)
        self.o = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b = x.size(0)
        q = self.q(x).view([b, 5, -1, 2]).transpose(1, 2)
        k = self.k(x).view([b, 5, -1, 2]).transpose(1, 2)
        v = self.v(x).view([b, 5, -1, 2]).transpose(1, 2)
        k = k.unsqueeze(2).expand([b, 2, 2, 5, 2]).reshape([b, 4, 5, 2])
        v = v.unsqueeze(2).expand([b, 2, 2, 5, 2]).reshape([b, 4, 5, 2])
        y = F.scaled_dot_product_attention(q, k, v, mask)
        return self.o(y.transpose(1, 2).reshape([b, 5, -1]))


class Fused(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(8, dim=-1)
        return self.proj(q * k + v)


class Stage(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.attn = Attention()
        self.mlp = SwiGLU()
        self.fused = Fused()
        self.head = nn.Linear(8, 10)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        x = x + self.attn(x, mask)
        x = x + self.mlp(x)
        return self.head(x + self.fused(x))


def test_rules_pair_swiglu_and_attention_and_keep_the_rest_replicated() -> None:
    plan = find_stage_plan(Stage(), 0)
    styles = {m.path: (m.style, m.group, m.owner, m.heads) for m in plan.split}
    assert styles == {
        "attn.q": ("colwise", "attn.o", "attn", 4),
        "attn.k": ("colwise", "attn.o", "attn", 2),
        "attn.v": ("colwise", "attn.o", "attn", 2),
        "attn.o": ("rowwise", "attn.o", "attn", None),
        "mlp.gate": ("colwise", "mlp.down", "mlp", None),
        "mlp.up": ("colwise", "mlp.down", "mlp", None),
        "mlp.down": ("rowwise", "mlp.down", "mlp", None),
    }
    kept = {k.path: k.reason for k in plan.replicated}
    assert set(kept) == {"emb", "fused.qkv", "fused.proj", "head"}
    assert "'split'" in kept["fused.qkv"]  # a fused projection: said why


def test_degree_decides_what_divides() -> None:
    plan = find_stage_plan(Stage(), 0)
    two = plan.for_degree(2)
    assert set(two.groups) == {"attn.o", "mlp.down"} and two.styles["attn.k"] == "colwise"
    assert set(two.owners) == {"attn", "mlp"}
    four = plan.for_degree(4)  # 4 query heads split, 2 KV heads do not: K and V replicated
    assert "attn.k" not in four.styles and four.styles["attn.q"] == "colwise"
    assert {k.path for k in four.replicated} >= {"attn.k", "attn.v"}
    three = plan.for_degree(3)  # nothing divides by 3
    assert not three.styles and not three.groups


def test_plan_round_trips_through_json(tmp_path: Path) -> None:
    plan = TensorParallelPlan((find_stage_plan(Stage(), 0),))
    plan.to_json(tmp_path / "tp_plan.json")
    assert TensorParallelPlan.from_json(tmp_path / "tp_plan.json") == plan
    assert "stage 0: 2 groups split (5 colwise, 2 rowwise)" in plan.summary(2)[0]


def test_partition_writes_the_plan_and_report_shows_it(tmp_path: Path) -> None:
    """A build carries tp_plan.json; `fxpipe report` prints what --tp 2 splits and keeps whole."""
    import subprocess
    import sys

    examples = Path(__file__).resolve().parents[2] / "examples"
    build = tmp_path / "build"
    run = [sys.executable, "-m", "fxpipe"]
    made = subprocess.run(
        [*run, "partition", str(examples / "mlp.py"), "--stages", "1", "--out", str(build)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert made.returncode == 0, made.stderr
    plan = TensorParallelPlan.from_json(build / "tp_plan.json")
    styles = {m.path: m.style for m in plan.stages[0].split}
    assert styles == {"layers.0.0": "colwise", "layers.1.0": "rowwise", "layers.2.0": "colwise", "layers.3.0": "rowwise"}  # fmt: skip
    report = subprocess.run(
        [*run, "report", str(build)], capture_output=True, text=True, timeout=300
    )
    assert report.returncode == 0, report.stderr
    again = subprocess.run(  # a build with its plan is a build: --out replaces it
        [*run, "partition", str(examples / "mlp.py"), "--stages", "1", "--out", str(build)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stderr
    text = " ".join(report.stdout.split())
    assert "tensor-parallel plan at --tp 2, stage 0: 2 groups split (2 colwise, 2 rowwise)" in text
    assert "head (no rule fits" in text


def test_a_build_without_a_plan_is_refused_and_an_override_is_read(tmp_path: Path) -> None:
    import pytest

    from fxpipe.codegen.tp_plan import read_tp_plan
    from fxpipe.errors import ConfigError

    with pytest.raises(ConfigError, match="has no tp_plan.json"):
        read_tp_plan(tmp_path)
    plan = TensorParallelPlan((find_stage_plan(Stage(), 0),))
    plan.to_json(tmp_path / "mine.json")
    assert read_tp_plan(tmp_path, tmp_path / "mine.json") == plan
    (tmp_path / "bad.json").write_text('{"stages": [{"stage": 0, "split": [{"path": "a"}]}]}')
    with pytest.raises(ConfigError, match="malformed"):
        read_tp_plan(tmp_path, tmp_path / "bad.json")
