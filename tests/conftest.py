"""Shared test fixtures: a fixed seed for every test and one registry of example models.

``EXAMPLES`` maps a short name to a model file in ``examples/``; use it directly
(``from conftest import EXAMPLES``) or through the ``load_example`` fixture, which
returns a loaded :class:`fxpipe.modelfile.ModelSource`.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Callable

import pytest
import torch

from fxpipe.modelfile import ModelSource, load_model_file

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = ROOT / "examples"
EXAMPLES: dict[str, Path] = {
    "mlp": EXAMPLES_DIR / "mlp.py",
    "gpt": EXAMPLES_DIR / "gpt.py",
    "resnet": EXAMPLES_DIR / "resnet.py",
    "branchy": EXAMPLES_DIR / "branchy.py",
}
HF_MODELS = EXAMPLES_DIR / "hf_models.py"  # GPT-2 by default; build_bert/bert_inputs for BERT


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
