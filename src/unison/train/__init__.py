"""Training: checkpoints and the pieces of the training loop."""
