"""Shared test fixtures: a fixed seed for every test and one registry of example models.

``EXAMPLES`` maps a short name to a model file in ``examples/``; use it directly
(``from example_models import EXAMPLES``) or through the ``load_example`` fixture, which
returns a loaded :class:`fxpipe.modelfile.ModelSource`.
"""

from __future__ import annotations

import random
from typing import Callable

import pytest
import torch

from example_models import EXAMPLES, HF_MODELS
from fxpipe.modelfile import ModelSource, load_model_file

@pytest.fixture(autouse=True)
def _seed() -> None:
    """Every test starts from the same random state."""
    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture
def load_example() -> Callable[[str], ModelSource]:
    """``load_example("gpt")`` -> the example's ModelSource (also accepts ``"hf_models"``)."""

    def load(name: str) -> ModelSource:
        path = HF_MODELS if name == "hf_models" else EXAMPLES[name]
        return load_model_file(path)

    return load
