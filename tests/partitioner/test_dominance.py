"""``ThresholdMin``, the exact memory test of the fast chain DP, against a literal loop."""

from __future__ import annotations

import numpy as np
import pytest

from fxpipe.partitioner.solve.dominance import ThresholdMin


def test_literal_answer() -> None:
    key = np.array([5.0, 1.0, 3.0, 4.0])
    need = np.array([0.0, 4.0, 2.0, 2.5])
    g = np.array([2.0, -1.0, 0.5, 7.0])
    # k=1: i=0 (key 5 >= 4) -> 2.0; k=2: i in {0, 1}, key >= 2 -> only 0 -> 2.0; k=3: key >= 2.5 -> i in {0, 2} -> 0.5
    np.testing.assert_array_equal(ThresholdMin(key, need).query(g), [np.inf, 2.0, 2.0, 0.5])


@pytest.mark.parametrize("seed", range(20))
def test_matches_brute_force(seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 70))
    key = rng.integers(0, 8, n).astype(float)
    need = rng.integers(0, 9, n).astype(float)
    g = rng.normal(size=n)
    g[rng.random(n) < 0.3] = np.inf
    expected = [
        min((g[i] for i in range(k) if key[i] >= need[k]), default=np.inf) for k in range(n)
    ]
    np.testing.assert_array_equal(ThresholdMin(key, need).query(g), expected)
