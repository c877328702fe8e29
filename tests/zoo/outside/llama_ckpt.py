"""A new user's Llama variant as llama_mqa.py, with gradient checkpointing enabled (model.gradient_checkpointing_enable())."""

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.append(str(Path(__file__).resolve().parent))  # for llama_mqa.py next to this file

from llama_mqa import build_model as build_mqa, example_inputs  # noqa: E402,F401


def build_model():
    model = build_mqa()
    model.gradient_checkpointing_enable()
    return model
