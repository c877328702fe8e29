"""The keys fxpipe stores in ``torch.fx`` graphs' ``meta`` dicts: one home for the whole vocabulary.

The tracer writes the first seven on the normalized graph it hands to codegen (Note
[normalized graph] in :mod:`fxpipe.tracer.traced`); codegen adds its own while it
splits and renders stages. Plain strings, so this module imports nothing.
"""

from __future__ import annotations

__all__ = [
    "SPEC_KEY",
    "PATH_KEY",
    "CONSTANTS_KEY",
    "GUARD_KEY",
    "MUTATIONS_KEY",
    "BUFFER_VALUES_KEY",
    "LIFTED_CONSTANT_PREFIX",
    "NAME_KEY",
    "ARITY_KEY",
    "ORIGIN_KEY",
]

# written by the tracer, read by codegen
SPEC_KEY = "fxpipe_spec"  # node.meta: TensorSpec | None | tuple of those
PATH_KEY = "fxpipe_path"  # node.meta: owning module path ("" = top level)
DIM_RANGES_KEY = "fxpipe_dim_ranges"  # graph_module.meta: symbol -> (min, max) export holds it for
CONSTANTS_KEY = "fxpipe_constants"  # graph_module.meta: names to register as non-persistent buffers
GUARD_KEY = "fxpipe_guard"  # node.meta: True/False = runs in train/eval mode only (fxpipe.tracer.train_eval.modes)
MUTATIONS_KEY = "fxpipe_mutations"  # graph_module.meta: in-place call name -> arguments it changes (tracer.mutation)
BUFFER_VALUES_KEY = (
    "fxpipe_buffer_values"  # graph_module.meta of a meta trace: buffer key -> its real value
)
LIFTED_CONSTANT_PREFIX = (
    "_fxpipe_const_"  # attribute names of the tensors a model makes in forward (export)
)

# codegen's own
NAME_KEY = "fxpipe_name"  # node.meta: the preferred variable name of the node's value
ARITY_KEY = "fxpipe_arity"  # node.meta: length of the tuple a node returns, when known
ORIGIN_KEY = (
    "fxpipe_origin"  # stage-graph node.meta: the original node a stage node copies (owned nodes)
)
