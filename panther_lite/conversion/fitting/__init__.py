"""Fitting: one layer from its weight and Gram, a planned list of layers (from Grams or
sequentially against the original outputs), and block-wise refinement."""
