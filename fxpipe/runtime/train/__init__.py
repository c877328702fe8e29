"""Training a build under ``fxpipe run``: the options a run is told (``run_options``,
``training_options``), its data, optimizer and schedule, the loop (``loop``), its checkpoints
(``checkpoint``, committed whole by ``commit``) and what a resume carries over (``resume``), a
run that diverges (``divergence``), its log and its record (``run.json``)."""
