"""Where a run's scalars go: TensorBoard and Weights & Biases, two sinks behind one interface."""
