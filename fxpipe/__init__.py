"""fxpipe: an ahead-of-time pipeline-parallel compiler for PyTorch."""

from fxpipe.errors import FxpipeError

__version__ = "0.1.0"
__all__ = ["FxpipeError", "__version__"]
