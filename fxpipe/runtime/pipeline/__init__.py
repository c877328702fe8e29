"""One pipeline step on one rank: process groups and the rank layout, schedules, the executor of a
rank's actions, each stage's F / B / W with their messages, microbatching, mixed precision, tied
parameters and clipping across stages; ``runner.PipelineRunner`` is the native API over them."""
