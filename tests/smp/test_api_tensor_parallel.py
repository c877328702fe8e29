"""The seed API with ``tensor_parallel_degree``: 2 partitions x tp 2 and 1 partition x tp 2 x 2
replicas (4 gloo processes) train as one process (fp32, rtol 1e-5: losses and every parameter),
through the runtime's tensor parallelism (``fxpipe.smp.tensor_parallel``), and a partial
checkpoint round-trips; a degree that cannot work is one ``ConfigError`` line."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fxpipe.errors import ConfigError
from fxpipe.smp.config import Config
from spawn import spawn

VOCAB, WIDTH, HEADS, SEQ = 13, 16, 4, 6
PARTITIONS, TP, MICROBATCHES, BATCH, LR, STEPS = 2, 2, 2, 4, 0.1, 3
TIGHT = {"rtol": 1e-5, "atol": 1e-6}


class Attention(nn.Module):
    """Heads split across the tp ranks: q, k, v column-wise, o row-wise."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
        self.v, self.o = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t = x.size(0), x.size(1)
        q = self.q(x).view([b, t, -1, WIDTH // HEADS]).transpose(1, 2)
        k = self.k(x).view([b, t, -1, WIDTH // HEADS]).transpose(1, 2)
        v = self.v(x).view([b, t, -1, WIDTH // HEADS]).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape([b, t, -1]))


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.proj = (
            nn.Linear(WIDTH, 2 * WIDTH),
            nn.GELU(),
            nn.Linear(2 * WIDTH, WIDTH),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(WIDTH), nn.LayerNorm(WIDTH)
        self.attn, self.mlp = Attention(), MLP()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def build() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int, replica: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * replica + step)
    return (
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
        torch.randint(0, VOCAB, (BATCH, SEQ), generator=g),
    )


def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.reshape(-1, VOCAB), target.reshape(-1))


def reference(replicas: int = 1) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process on the replicas' batches concatenated (replica r's batch of step k: ``batch(k, r)``)."""
    model = copy.deepcopy(build()).train()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    chunks = replicas * MICROBATCHES
    for k in range(STEPS):
        opt.zero_grad()
        parts = [batch(k, r) for r in range(replicas)]
        ids, target = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        total = 0.0
        for x, y in zip(ids.chunk(chunks), target.chunk(chunks)):
            loss = loss_fn(model(x), y)
            (loss / chunks).backward()
            total += loss.item()
        opt.step()
        losses.append(total / chunks)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _job(
    rank: int, world: int, partitions: int, ckdir: str | None = None, compile: bool = False
) -> dict[str, Any]:
    import fxpipe.smp as smp
    import fxpipe.smp.model as seed_model
    from fxpipe.runtime.pipeline.compiled import compiled_graphs

    compiled = seed_model.compile_stages
    at_compile: list[int] = []  # graphs once this rank's stages compiled and warmed up

    def counted(*args: Any, **kwargs: Any) -> Any:
        warm_up = compiled(*args, **kwargs)
        at_compile.append(compiled_graphs())
        return warm_up

    seed_model.compile_stages = counted  # type: ignore[assignment]
    dist.init_process_group("gloo")
    smp.init(
        {
            "partitions": partitions,
            "microbatches": MICROBATCHES,
            "tensor_parallel_degree": TP,
            "pipeline": "interleaved",
            "ddp": True,
            "compile": compile,
        }
    )
    model = smp.DistributedModel(build(), trace_device="cpu")
    opt = smp.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=LR))

    @smp.step
    def train_step(model: Any, ids: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(model(ids), target)
        model.backward(loss)
        return loss

    losses = []
    for k in range(STEPS):
        opt.zero_grad()
        losses.append(train_step(model, *batch(k, smp.dp_rank())).reduce_mean().item())
        opt.step()
    from torch.distributed.tensor import DTensor

    split = sum(1 for p in model.local_parameters() if isinstance(p, DTensor))
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    ranks = (smp.mp_rank(), smp.tp_rank(), smp.tp_size(), smp.dp_rank())
    out = {"losses": losses, "state": state, "split": split, "ranks": ranks}
    out["graphs"] = compiled_graphs(), at_compile
    if ckdir is not None:  # a partial checkpoint: one part per stage, loaded into every tp rank
        path = f"{ckdir}/model.pt"
        smp.save(model.local_state_dict(), path, partial=True)
        smp.barrier()
        with torch.no_grad():
            for p in model.local_parameters():
                p.zero_()
        model.load_state_dict(smp.load(path, partial=True))
        out["reloaded"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
        smp.barrier()
    smp.shutdown()
    return out


def _check(
    results: list[dict[str, Any]], partitions: int, replicas: int, close: Any = TIGHT
) -> None:
    want_losses, want_state = reference(replicas)
    assert want_losses[-1] < want_losses[0]
    by_replica: dict[int, list[float]] = {}
    for rank, res in enumerate(results):
        # tp innermost, then the stage, then the replica
        assert res["ranks"] == ((rank // TP) % partitions, rank % TP, TP, rank // (partitions * TP))
        assert res["split"] > 0, f"rank {rank} holds no split parameter"
        by_replica[res["ranks"][3]] = res["losses"]
        assert list(res["state"]) == list(want_state)
        torch.testing.assert_close(res["state"], want_state, **close, msg=f"rank {rank}")
    mean = torch.tensor([by_replica[r] for r in range(replicas)]).mean(0)
    torch.testing.assert_close(mean, torch.tensor(want_losses), **close)


@pytest.mark.distributed
def test_two_partitions_x_tp2_train_as_one_process(tmp_path: Path) -> None:
    results = [
        r.value for r in spawn(_job, PARTITIONS * TP, PARTITIONS, str(tmp_path), timeout=600)
    ]
    _check(results, PARTITIONS, 1)
    for res in results:  # smp.save(partial=True) wrote each stage once; every tp rank loaded it
        torch.testing.assert_close(res["reloaded"], res["state"], rtol=0, atol=0)
    parts = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("model.pt_"))
    assert parts == ["model.pt_0", "model.pt_1"]


@pytest.mark.distributed
def test_one_partition_x_tp2_x_two_replicas_train_as_one_process() -> None:
    """DDP over the replicas of each tp shard (Note [TP under DDP]); each replica its own batch."""
    results = [r.value for r in spawn(_job, TP * 2, 1, timeout=600)]
    _check(results, 1, 2)


@pytest.mark.distributed
def test_compiled_tp2_stages_train_as_one_process() -> None:
    """``compile: True`` with ``tensor_parallel_degree``: each rank's stage is compiled after the
    split, as it runs (DTensor parameters), as ``fxpipe run --tp --compile`` compiles it; one
    partition x tp 2 trains as one eager process (rtol 1e-4: compiled kernels round otherwise)."""
    results = [r.value for r in spawn(_job, TP, 1, None, True, timeout=900)]
    for res in results:  # compiled after the split, as the steps run it: they compile nothing
        graphs, at_compile = res["graphs"]
        assert at_compile == [graphs] and graphs > 0, res["graphs"]
    _check(results, 1, 1, {"rtol": 1e-4, "atol": 1e-5})


def test_a_degree_that_cannot_work_is_one_line() -> None:
    from fxpipe.smp.tensor_parallel import stage_plans

    base = {"partitions": 2, "tensor_parallel_degree": 2}
    with pytest.raises(ConfigError, match="needs 'ddp': True"):
        Config.from_dict(base).check_world(8)
    assert Config.from_dict({**base, "ddp": True}).check_world(8) == 2
    with pytest.raises(ConfigError, match=r"x 'tensor_parallel_degree' 2 = 4 does not divide"):
        Config.from_dict(base).check_world(6)
    with pytest.raises(ConfigError, match="'tensor_parallel_degree' must be an int >= 1"):
        Config.from_dict({**base, "tensor_parallel_degree": 0})
    with pytest.raises(ConfigError, match="not 'shard': 'full'"):
        Config.from_dict({**base, "ddp": True, "shard": "full"})
    block = Block()
    assert stage_plans({0: block}, 2)[0].groups  # heads and features divide by 2
    with pytest.raises(ConfigError) as info:
        stage_plans({0: block}, 3)  # 4 heads, 16 and 32 features: nothing divides by 3
    message = str(info.value)
    assert "\n" not in message and "cannot split stage 0" in message
    assert "not divisible by tp 3" in message
