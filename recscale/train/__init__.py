"""Training: typed config, the loop, evaluation metrics."""
