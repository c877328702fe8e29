"""Launching a job: ``fxpipe run`` (``launcher.run_build``) checks what it can first
(``preflight``), starts torchrun (``agent``) with one ``worker`` per rank, and ties each worker's
life to its parent's (``lifeline``)."""
