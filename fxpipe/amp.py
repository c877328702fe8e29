"""``fxpipe.amp``: the seed's ``smp.amp`` namespace (a pipeline-aware ``GradScaler``)."""

from fxpipe.runtime.api.amp import GradScaler

__all__ = ["GradScaler"]
