"""FairScale's auto-wrapping example: ``enable_wrap`` / ``wrap`` / ``auto_wrap`` on a Transformer.

Only the imports differ from FairScale's text (was ``from fairscale.nn.wrap import
auto_wrap, enable_wrap, wrap`` and ``from fairscale.nn.data_parallel import
FullyShardedDataParallel as FSDP``); FairScale's ``DummyProcessGroup(rank=0, size=1)``
is the real world group of 2 gloo ranks here, and its ``min_num_params=1e6`` is scaled
to this smaller Transformer (``d_model=64``: 1e6 / 64 parameters picks the same modules
as 1e6 does at the default ``d_model=512``). ``python examples/fairscale_scripts/auto_wrap.py``
checks FairScale's assertions, then trains the auto-wrapped Transformer on 2 ranks and
checks it against the same loop under plain DDP.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_against_ddp, dist_init, full_state, spawn  # noqa: E402

from fxpipe.sharding import FullyShardedDataParallel as FSDP  # noqa: E402
from fxpipe.sharding import auto_wrap, enable_wrap, wrap  # noqa: E402

D_MODEL, STEPS = 64, 3
MIN_NUM_PARAMS = 1e6 * (D_MODEL / 512) ** 2


def transformer() -> nn.Transformer:
    return nn.Transformer(
        d_model=D_MODEL,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        dim_feedforward=4 * D_MODEL,
        dropout=0.0,
        batch_first=True,
    )


def check_wrapping(rank: int, world_size: int) -> dict[str, Any]:
    """FairScale's example, with its assertions."""
    dist_init(rank, world_size)
    tfmr = transformer()
    group = dist.group.WORLD
    fsdp_params = dict(mixed_precision=True, flatten_parameters=True)
    with enable_wrap(wrapper_cls=FSDP, process_group=group, **fsdp_params):
        # Wraps layer in FSDP by default if within context
        l1 = wrap(torch.nn.Linear(5, 5))
        assert isinstance(l1, FSDP)
        assert l1.mixed_precision and l1.flatten_parameters
        # Separately Wraps children modules with more than 1e8 params
        l2 = auto_wrap(tfmr, min_num_params=MIN_NUM_PARAMS)
        assert isinstance(l2, nn.Transformer)
        for l in l2.encoder.layers:  # noqa: E741 - FairScale's name
            assert isinstance(l, FSDP)
            assert l.mixed_precision and l.flatten_parameters
            assert isinstance(l.linear1, FSDP)
            assert isinstance(l.linear2, FSDP)
            assert not isinstance(l.self_attn, FSDP)  # self attention is not auto-wrapped
    outside = wrap(nn.Linear(2, 2))
    return {
        "wrapped": sorted(name for name, m in l2.named_modules() if isinstance(m, FSDP)),
        "outside_context": type(outside).__name__,
    }


def _batches(rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(rank)
    return [
        (torch.randn(2, 5, D_MODEL, generator=g), torch.randn(2, 3, D_MODEL, generator=g))
        for _ in range(STEPS)
    ]


def train(rank: int, world_size: int, sharded: bool) -> dict[str, Any]:
    """A few SGD steps of the Transformer, auto-wrapped in FSDP (fp32) or in plain DDP."""
    dist_init(rank, world_size)
    model: nn.Module = transformer()
    if sharded:
        with enable_wrap(wrapper_cls=FSDP):
            model = FSDP(auto_wrap(model, min_num_params=MIN_NUM_PARAMS))
    else:
        model = DDP(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for src, tgt in _batches(rank):
        optimizer.zero_grad()
        loss = model(src, tgt).pow(2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return {"losses": losses, "state": full_state(model)}


def main() -> None:
    wrapped = spawn(check_wrapping)[0]
    print(f"FairScale's assertions hold; FSDP units: {wrapped['wrapped']}")
    check_against_ddp(
        "auto_wrap(Transformer) in FSDP",
        spawn(train, True),
        spawn(train, False),
        rtol=1e-4,
        atol=1e-5,
    )


if __name__ == "__main__":
    main()
