"""Tracer: FX/export tracing under a leaf policy, shape propagation and unit profiling.

The torch-free data classes (``ModelProfile`` and friends) import eagerly; everything
that needs torch loads on first use, so the partitioner can read profiles without
importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fxpipe._lazy import lazy_exports, type_checking_exports
from fxpipe.tracer.profile import ModelInfo, ModelProfile, TensorSpec, Unit, UnitEdge

if TYPE_CHECKING:
    from fxpipe.tracer.api import trace_model, trace_model_file
    from fxpipe.tracer.construct.pins import partition
    from fxpipe.tracer.construct.record import BuildRecord, build_model_recorded
    from fxpipe.tracer.measure.meta import build_on_meta
    from fxpipe.tracer.table import print_profile_table
    from fxpipe.tracer.traced import TracedModel

# the names above, imported on first use (Note [one list of lazy names] in fxpipe._lazy)
_LAZY = type_checking_exports(__file__)

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
