"""Reports of a plan: terminal tables (``terminal``) and the self-contained ``report.html``
(``html``, with its charts in ``charts`` and its unit view in ``units``)."""
