"""numpy's global random state is one of a rank's streams in a checkpoint (Note [numpy's stream in
a checkpoint]): a stage may draw from it at every call (SpecAugment's masks, issue 37), so a
resumed job must continue it as it continues torch's and Python's, in both checkpoint formats.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from builds import make_build
from fxpipe.modelfile import load_model_file
from spawn import spawn

DROPOUT = Path(__file__).with_name("dropout_mlp.py")
BATCH, MICROBATCHES = 4, 2


def _state() -> tuple[list[int], int]:
    """numpy's global state: the generator's key and its position in it."""
    _, keys, pos, _, _ = np.random.get_state(legacy=True)
    return keys.tolist(), int(pos)


def _job(rank: int, world: int, build: str, ckdir: str) -> dict[str, Any]:
    from fxpipe.runtime import PipelineRunner
    from fxpipe.runtime.train.checkpoint import (
        load_training_checkpoint,
        restore_training_state,
        save_training_checkpoint,
        training_state,
    )
    from fxpipe.runtime.train.commit import read_record
    from fxpipe.runtime.train.dcp_checkpoint import load_dcp_checkpoint, save_dcp_checkpoint

    source = load_model_file(DROPOUT)
    x, y = source.example_inputs(BATCH)[0], source.example_targets(BATCH)
    np.random.seed(7)
    with PipelineRunner(build, source.loss_fn, microbatches=MICROBATCHES, timeout_s=60) as runner:
        runner.step(x, y)
        np.random.rand(3)  # the job drew from numpy before the checkpoint
        want = _state()
        per_rank, model_keyed = Path(ckdir) / "per_rank", Path(ckdir) / "dcp"
        save_training_checkpoint(per_rank, rank, world, training_state(runner, 1, 0, {}), {})
        save_dcp_checkpoint(model_keyed, runner, 1, BATCH, {"losses": []}, {})
        got = {}
        np.random.rand(1000)  # a fresh process's state is another one
        restore_training_state(runner, load_training_checkpoint(per_rank, rank, world))
        got["per_rank"] = _state()
        np.random.rand(1000)
        record = read_record(model_keyed / "checkpoint.json")
        assert record is not None
        load_dcp_checkpoint(runner, model_keyed, record)
        got["dcp"] = _state()
    return {"want": want, **got}


@pytest.mark.distributed
def test_a_checkpoint_restores_numpys_stream_in_both_formats(tmp_path: Path) -> None:
    build = str(make_build(DROPOUT, tmp_path / "b", 1, BATCH, MICROBATCHES))
    (result,) = spawn(_job, 1, build, str(tmp_path / "ck"), timeout=240)
    got = result.value
    assert got["per_rank"] == got["want"]
    assert got["dcp"] == got["want"]
