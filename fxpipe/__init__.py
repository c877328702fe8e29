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

from fxpipe._lazy import lazy_exports
from fxpipe.errors import FxpipeError

__version__ = "0.1.0"

_LAZY: dict[str, str] = {
    # compiler
    **dict.fromkeys(("trace_model", "trace_model_file", "ModelProfile", "partition"), "tracer"),
    **dict.fromkeys(("plan_partition", "PartitionPlan", "CostModel"), "partitioner"),
    **dict.fromkeys(
        ("write_build_dir", "load_stage", "load_pipeline", "verify_build", "Manifest"), "codegen"
    ),
    "PipelineRunner": "runtime",
    "load_model_file": "modelfile",
    # the seed documents' training API
    **dict.fromkeys(
        (
            "init",
            "step",
            "StepOutput",
            "DistributedModel",
            "DistributedOptimizer",
            "save",
            "load",
            "rank",
            "size",
            "local_rank",
            "local_size",
            "mp_rank",
            "mp_size",
            "dp_rank",
            "dp_size",
            "tp_rank",
            "tp_size",
            "barrier",
            "broadcast",
            "is_initialized",
            "is_tracing",
            "get_world_process_group",
            "get_mp_process_group",
            "get_dp_process_group",
            "get_tp_process_group",
            "shutdown",
            "StepError",
            "CheckpointError",
        ),
        "smp",
    ),
}
_SUBMODULES = ("amp", "smp", "tracer", "partitioner", "codegen", "runtime", "errors", "modelfile")

__all__ = ["FxpipeError", "__version__", "amp", *_LAZY]

__getattr__, __dir__ = lazy_exports(globals(), _LAZY, _SUBMODULES)
