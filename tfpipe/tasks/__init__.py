"""Tasks: what a model computes, its losses, metrics and decoder."""
