"""Each data-parallel replica's rows of the example batch, without processes."""

from __future__ import annotations

import pytest
import torch

from fxpipe.errors import ModelFileError
from fxpipe.runtime.train.data import replica_batch


def test_replica_batch_cuts_each_input_along_its_batch_dim_and_targets_along_dim_0() -> None:
    x = torch.arange(24).view(2, 6, 2)  # batch dim 1
    shared = torch.ones(3)
    targets = {"y": torch.arange(6), "scale": torch.tensor(2.0)}
    parts = [replica_batch((x, shared), targets, [1, None], r, 2) for r in range(3)]
    torch.testing.assert_close(torch.cat([p[0][0] for p in parts], dim=1), x)
    assert all(p[0][1] is shared for p in parts)
    assert [p[1]["y"].tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert all(p[1]["scale"] is targets["scale"] for p in parts)
    with pytest.raises(
        ModelFileError, match=r"has 6 rows along dim 1, but replica 3 needs rows \[6, 8\)"
    ):
        replica_batch((x,), targets, [1], 3, 2)
