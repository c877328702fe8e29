"""The one registry of example model files that tests in every folder share.

Import it as ``from example_models import EXAMPLES`` (pytest puts ``tests/`` on the
path); ``conftest.py`` builds its fixtures from it.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES_DIR = ROOT / "examples"
EXAMPLES: dict[str, Path] = {
    "mlp": EXAMPLES_DIR / "mlp.py",
    "gpt": EXAMPLES_DIR / "gpt.py",
    "resnet": EXAMPLES_DIR / "resnet.py",
    "branchy": EXAMPLES_DIR / "branchy.py",
}
HF_MODELS = EXAMPLES_DIR / "hf_models.py"  # GPT-2 by default; build_bert/bert_inputs for BERT
HF_LM = (
    EXAMPLES_DIR / "hf_lm.py"
)  # unwrapped GPT-2 (build_bart/bart_inputs: BART), keyword inputs, labels=, no loss_fn
