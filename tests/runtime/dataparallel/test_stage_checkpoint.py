"""Stage checkpoints in one process (a single replica: no data-parallel group), both formats."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from fxpipe.errors import CheckpointError
from fxpipe.runtime.dataparallel.state_dict import (
    checkpoint_paths,
    load_stage_checkpoint,
    save_stage_checkpoint,
)


def _model_and_optimizer(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    model.unused = nn.Parameter(torch.ones(3))  # never gets a gradient, so never optimizer state
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _steps(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> None:
    for k in steps:
        opt.zero_grad()
        g = torch.Generator().manual_seed(k)
        model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
        opt.step()


@pytest.mark.parametrize("sharded", [True, False])
def test_resume_from_either_format_is_bit_exact(tmp_path: Path, sharded: bool) -> None:
    want, opt = _model_and_optimizer(0)
    _steps(want, opt, range(4))
    model, opt = _model_and_optimizer(0)
    _steps(model, opt, range(2))
    written = save_stage_checkpoint(tmp_path, 3, model, opt, None, sharded=sharded)
    assert written == checkpoint_paths(tmp_path, 3)[0 if not sharded else 1] and written.exists()
    assert not list(tmp_path.glob(".*"))  # no temporary left behind
    resumed, opt = _model_and_optimizer(1)
    load_stage_checkpoint(tmp_path, 3, resumed, opt, None)
    assert resumed.unused not in opt.state
    _steps(resumed, opt, range(2, 4))
    for (key, a), b in zip(want.state_dict().items(), resumed.state_dict().values()):
        assert torch.equal(a, b), key


def test_an_interrupted_swap_falls_back_to_the_old_checkpoint(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer(0)
    _steps(model, opt, range(1))
    shards = save_stage_checkpoint(tmp_path, 0, model, opt, None)
    shards.rename(shards.with_name(f"{shards.name}.old"))  # a crash between the two renames
    fresh, opt2 = _model_and_optimizer(1)
    load_stage_checkpoint(tmp_path, 0, fresh, opt2, None)
    assert torch.equal(fresh[0].weight, model[0].weight)


def test_missing_or_mismatched_checkpoints_are_clear_errors(tmp_path: Path) -> None:
    model, opt = _model_and_optimizer(0)
    with pytest.raises(
        CheckpointError, match=r"no checkpoint of stage 5 in .*stage_5.pt \(full\) nor stage_5/"
    ):
        load_stage_checkpoint(tmp_path, 5, model, opt, None)
    save_stage_checkpoint(tmp_path, 0, nn.Linear(4, 8), None, None, sharded=False)
    with pytest.raises(CheckpointError, match="has no"):
        load_stage_checkpoint(tmp_path, 0, model, opt, None)
