"""Calibration: the data (batches or a callable, run in eval mode), the per-layer input Grams
recorded from it, their shrinkage, and random-token batches for language models."""
