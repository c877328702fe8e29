"""``python -m fxpipe`` is the ``fxpipe`` command."""

from fxpipe.cli import main

raise SystemExit(main())
