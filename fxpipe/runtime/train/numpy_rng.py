"""numpy's global random state as plain JSON text, saved and restored with a rank's other generators.

Note [numpy's stream in a checkpoint]: a stage may draw from numpy's global state at every call
(SpecAugment's masks, Note [masks drawn on the host] in ``fxpipe.tracer.frontend.host_masks``),
so numpy's state is one of a rank's random streams, as torch's and Python's are: a checkpoint
stores it beside them and a resumed job continues it, drawing the masks the uninterrupted job
draws. The state is JSON text (the MT19937 key as a list of ints) so that both checkpoint formats
can hold it: the per-rank files read with ``weights_only=True`` and DCP's plain entries.
"""

from __future__ import annotations

import json
import sys

__all__ = ["numpy_rng_state", "set_numpy_rng_state"]


def numpy_rng_state() -> str | None:
    """numpy's global random state as JSON text; None when nothing has imported numpy."""
    numpy = sys.modules.get("numpy")
    if numpy is None:
        return None
    kind, keys, pos, has_gauss, gauss = numpy.random.get_state(legacy=True)
    return json.dumps([kind, keys.tolist(), int(pos), int(has_gauss), float(gauss)])


def set_numpy_rng_state(text: str) -> None:
    """Restore numpy's global random state from :func:`numpy_rng_state`'s text."""
    import numpy as np

    kind, keys, pos, has_gauss, gauss = json.loads(text)
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
