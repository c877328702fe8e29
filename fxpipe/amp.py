"""``fxpipe.amp``: the seed's ``smp.amp`` namespace (a pipeline-aware ``GradScaler``)."""

from fxpipe.smp.amp import GradScaler

__all__ = ["GradScaler"]
