"""Tracer: FX/export tracing under a leaf policy, shape propagation and unit profiling.

The torch-free data classes (``ModelProfile`` and friends) import eagerly; everything
that needs torch loads on first use, so the partitioner can read profiles without
importing torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from fxpipe.tracer.profile import ModelInfo, ModelProfile, TensorSpec, Unit, UnitEdge

_LAZY = {
    "trace_model": "fxpipe.tracer.api",
    "trace_model_file": "fxpipe.tracer.api",
    "partition": "fxpipe.tracer.pins",
    "BuildRecord": "fxpipe.tracer.record",
    "build_model_recorded": "fxpipe.tracer.record",
    "print_profile_table": "fxpipe.tracer.table",
    "TracedModel": "fxpipe.tracer.traced",
}

__all__ = [
    "trace_model",
    "trace_model_file",
    "partition",
    "print_profile_table",
    "build_model_recorded",
    "BuildRecord",
    "TracedModel",
    "ModelInfo",
    "ModelProfile",
    "TensorSpec",
    "Unit",
    "UnitEdge",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'fxpipe.tracer' has no attribute {name!r}")
