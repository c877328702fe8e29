"""fxpipe: an ahead-of-time pipeline-parallel compiler for PyTorch.

The package root re-exports the public API and nothing else:

* the compiler: ``trace_model``, ``plan_partition``, ``write_build_dir``, ``load_stage``,
  ``load_pipeline``, ``verify_build``, ``PipelineRunner``;
* the training API of the seed documents (``fxpipe.smp``), so that ``import fxpipe as smp``
  ports a script written for ``smdistributed.modelparallel.torch``: ``init``, ``step``,
  ``DistributedModel``, ``DistributedOptimizer``, ``partition``, ``save``, ``load``,
  ``rank``, ``size``, … and ``fxpipe.amp.GradScaler``.

Names load on first use, so ``import fxpipe`` (and the CLI's start-up) does not
import torch until something needs it.
"""

from __future__ import annotations

import importlib
from typing import Any

from fxpipe.errors import FxpipeError

__version__ = "0.1.0"

_API = "fxpipe.smp"
_LAZY: dict[str, str] = {
    # compiler
    "trace_model": "fxpipe.tracer",
    "trace_model_file": "fxpipe.tracer",
    "ModelProfile": "fxpipe.tracer",
    "plan_partition": "fxpipe.partitioner",
    "PartitionPlan": "fxpipe.partitioner",
    "CostModel": "fxpipe.partitioner",
    "write_build_dir": "fxpipe.codegen",
    "load_stage": "fxpipe.codegen",
    "load_pipeline": "fxpipe.codegen",
    "verify_build": "fxpipe.codegen",
    "Manifest": "fxpipe.codegen",
    "PipelineRunner": "fxpipe.runtime",
    "load_model_file": "fxpipe.modelfile",
    # the seed documents' training API
    "partition": "fxpipe.tracer",
    **{name: _API for name in (
        "init", "step", "StepOutput", "DistributedModel", "DistributedOptimizer", "save", "load",
        "rank", "size", "local_rank", "local_size", "mp_rank", "mp_size", "dp_rank", "dp_size",
        "barrier", "broadcast", "is_initialized", "is_tracing",
        "get_world_process_group", "get_mp_process_group", "get_dp_process_group", "shutdown",
        "StepError", "CheckpointError",
    )},
}
_SUBMODULES = {"amp", "smp", "tracer", "partitioner", "codegen", "runtime", "errors", "modelfile"}

__all__ = ["FxpipeError", "__version__", "amp", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
    elif name in _SUBMODULES:
        value = importlib.import_module(f"fxpipe.{name}")
    else:
        raise AttributeError(f"module 'fxpipe' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
