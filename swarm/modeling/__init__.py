"""Model code: one module per family's block math, model configs and shapes, checkpoints and the disk cache."""
