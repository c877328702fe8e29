"""Train and eval mode in one graph: mode guards, the eval-mode trace, merging the two, and probing whether a model's modes differ."""
