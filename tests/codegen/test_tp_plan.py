"""The tensor-parallel rules (Note [tensor-parallel rules] in fxpipe.codegen.tp_plan) on tiny modules."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.codegen.tp_plan import (
    TensorParallelPlan,
    VocabSplit,
    find_stage_plan,
    find_tp_plan,
)


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
    assert set(kept) == {"fused.qkv", "fused.proj", "head"}  # not the last stage: no LM head
    assert "'split'" in kept["fused.qkv"]  # a fused projection: said why
    assert plan.vocab == (VocabSplit("emb", "embedding", 10),)  # split over its vocabulary


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
    assert "vocabulary-parallel LM head: head, logits sharded" in text  # the classifier's 10 rows


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


# -- vocabulary-parallel embeddings and LM heads (Note [vocabulary-parallel]) --------------------


class LM(nn.Module):
    """An embedding, a block, an LM head; ``loss`` how the stage ends: its logits alone, its own
    cross entropy with ``labels`` (returned with the logits), or one with label smoothing."""

    def __init__(self, vocab: int = 12, tied: bool = False, loss: str = "") -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.mlp = SwiGLU()
        self.head = nn.Linear(8, vocab, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        self.loss, self.vocab = loss, vocab

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(self.mlp(self.emb(ids)))
        if not self.loss:
            return logits
        flat = logits.float().view(-1, self.vocab)
        smoothing = 0.1 if self.loss == "smoothed" else 0.0
        return logits, F.cross_entropy(flat, labels.view(-1), label_smoothing=smoothing)


class FunctionalHead(LM):
    """A tied head the emitter writes as a call: ``F.linear(h, self.emb.weight)``."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = F.linear(self.mlp(self.emb(ids)), self.emb.weight)
        return F.cross_entropy(logits.view(-1, self.vocab), labels.view(-1))


class Argmax(LM):
    """Its logits also feed an argmax: loss_parallel cannot take them."""

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> Any:
        logits = self.head(self.mlp(self.emb(ids)))
        return logits, logits.argmax(-1)


def test_the_last_stage_splits_its_head_and_says_what_the_logits_feed() -> None:
    plan = find_stage_plan(LM(), 0, last=True)
    assert set(plan.vocab) == {
        VocabSplit("emb", "embedding", 12),
        VocabSplit("head", "head", 12, "loss_fn"),
    }
    two = plan.for_degree(2)
    assert two.styles["emb"] == "vocab_embedding" and two.styles["head"] == "vocab_head"
    assert (two.head, two.head_loss) == ("head", "loss_fn")
    own = find_stage_plan(LM(loss="ce"), 0, last=True).for_degree(2)
    assert (own.head, own.head_loss) == ("head", "cross_entropy")
    assert (
        "the stage's cross entropy under loss_parallel"
        in TensorParallelPlan((find_stage_plan(LM(loss="ce"), 0, last=True),)).summary(2)[0]
    )


def test_a_vocabulary_the_degree_does_not_divide_stays_replicated() -> None:
    five = find_stage_plan(LM(vocab=10), 0, last=True).for_degree(4)
    assert "emb" not in five.styles and "head" not in five.styles and not five.head
    kept = {k.path: k.reason for k in five.replicated}
    assert kept["emb"] == kept["head"] == "a vocabulary of 10 is not divisible by tp 4"


def test_logits_loss_parallel_cannot_take_keep_the_head_and_its_tied_embedding_whole() -> None:
    smoothed = find_stage_plan(LM(tied=True, loss="smoothed"), 0, last=True)
    kept = {k.path: k.reason for k in smoothed.replicated}
    assert not smoothed.vocab and "label smoothing" in kept["head"] and "tied to" in kept["emb"]
    argmax = find_stage_plan(Argmax(), 0, last=True)
    assert {v.path for v in argmax.vocab} == {"emb"}  # untied: the embedding still splits
    assert "'argmax' on the logits" in {k.path: k.reason for k in argmax.replicated}["head"]


def test_tied_heads_split_with_their_embedding_on_one_stage_or_across_stages() -> None:
    tied = find_stage_plan(LM(tied=True), 0, last=True).for_degree(2)
    assert tied.styles["emb"] == "vocab_embedding" and tied.styles["head"] == "vocab_head"
    functional = find_stage_plan(FunctionalHead(), 0, last=True)
    assert VocabSplit("emb", "tied_head", 12, "cross_entropy") in functional.vocab
    two = functional.for_degree(2)  # split as its embedding: no style of its own
    assert two.styles == {**two.styles, "emb": "vocab_embedding"} and two.head == "emb"
    said = TensorParallelPlan((functional,)).summary(2)[0]
    assert "vocabulary-parallel LM head: F.linear over emb.weight, logits sharded" in said
    ties = [[(0, "emb.weight"), (1, "head.weight")]]
    apart = find_tp_plan([LM(), LM()], ties)  # the head on stage 1 splits: so does stage 0's emb
    assert apart.stage(0).for_degree(2).styles["emb"] == "vocab_embedding"
    whole = find_tp_plan([LM(), Argmax()], ties)  # stage 1's head stays whole: so does the emb
    kept = {k.path: k.reason for k in whole.stage(0).replicated}
    assert "emb" not in whole.stage(0).for_degree(2).styles
    assert kept["emb"] == "tied to head on stage 1, which stays replicated"


def test_a_plan_with_vocabulary_splits_round_trips(tmp_path: Path) -> None:
    plan = find_tp_plan([LM(), LM(loss="ce")], [[(0, "emb.weight"), (1, "head.weight")]])
    plan.to_json(tmp_path / "tp_plan.json")
    assert TensorParallelPlan.from_json(tmp_path / "tp_plan.json") == plan
