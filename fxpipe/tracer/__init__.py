"""Tracer: FX/export tracing under a leaf policy, shape propagation and unit profiling.

The torch-free data classes (``ModelProfile`` and friends) import eagerly; everything
that needs torch loads on first use, so the partitioner can read profiles without
importing torch.
"""

from __future__ import annotations

from fxpipe._lazy import lazy_exports
from fxpipe.tracer.profile import ModelInfo, ModelProfile, TensorSpec, Unit, UnitEdge

_LAZY = {
    "trace_model": "api",
    "trace_model_file": "api",
    "partition": "pins",
    "BuildRecord": "record",
    "build_model_recorded": "record",
    "print_profile_table": "table",
    "TracedModel": "traced",
    "build_on_meta": "meta",
}

__all__ = [
    "trace_model",
    "trace_model_file",
    "partition",
    "print_profile_table",
    "build_model_recorded",
    "BuildRecord",
    "TracedModel",
    "build_on_meta",
    "ModelInfo",
    "ModelProfile",
    "TensorSpec",
    "Unit",
    "UnitEdge",
]

__getattr__, __dir__ = lazy_exports(globals(), _LAZY)
