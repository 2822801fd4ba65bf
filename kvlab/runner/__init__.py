"""Running: the Lightning module, the prediction writer, progress, TensorBoard views, compare and the
reference table."""
