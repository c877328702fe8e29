"""How a model was built: observed constructors, rebuilding a module from its configuration, manual stage pins, computed buffers of a meta-built model."""
