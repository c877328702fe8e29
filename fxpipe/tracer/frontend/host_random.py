"""Random numbers a model draws with numpy in forward: a trace would keep one draw as a constant.

Note [numpy random numbers]: ``torch.export`` records torch operations; a value computed with
numpy in forward is a constant of the graph. When that value is random (Wav2Vec2's SpecAugment
draws its time masks with ``np.random`` in train mode), the stages would apply the trace's one
draw on every step while the model draws a new one each call: a different model. SpecAugment's
mask function is replaced by an operator that calls it at run time (Note [masks drawn on the
host]); any other draw is refused: fxpipe's check would refuse the build later, for outputs that
differ, so :func:`numpy_draws` finds the cause while tracing, and :func:`refuse_numpy_draws`
names the line and the remedy instead.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
from pathlib import Path
from typing import Any, Iterator

from fxpipe.errors import TraceError

__all__ = ["numpy_draws", "refuse_numpy_draws"]

_DRAWS = (
    "rand", "randn", "randint", "random", "random_sample", "choice", "uniform", "normal",
    "permutation", "shuffle", "binomial", "poisson",
)  # fmt: skip


@contextlib.contextmanager
def numpy_draws(found: list[tuple[str, int]]) -> Iterator[None]:
    """Record the model's line of every ``np.random.<draw>`` call made in the block."""
    try:
        import numpy.random as npr
    except ImportError:  # no numpy: nothing to watch
        yield
        return
    from fxpipe.tracer.frontend.data_checks import caller_site

    saved = {name: getattr(npr, name) for name in _DRAWS if hasattr(npr, name)}

    def watched(name: str, fn: Any) -> Any:
        @functools.wraps(fn)
        def draw(*args: Any, **kwargs: Any) -> Any:
            site = caller_site()
            if site is not None and site not in found:
                found.append(site)
            return fn(*args, **kwargs)

        return draw

    for name, fn in saved.items():
        setattr(npr, name, watched(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(npr, name, fn)


def refuse_numpy_draws(model_name: str, found: list[tuple[str, int]]) -> None:
    """A TraceError naming the first line that drew numpy random numbers (Note [numpy random numbers])."""
    if not found:
        return
    filename, line = found[0]
    code = linecache.getline(filename, line).strip()
    raise TraceError(
        f"{model_name} draws random numbers with numpy in forward at {Path(filename).name}:{line} "
        f"(`{code}`): a trace keeps one draw as a constant, so the stages would repeat it every "
        "step; draw them with torch (torch.rand, torch.randint), or turn that feature off in train "
        "mode"
    )
