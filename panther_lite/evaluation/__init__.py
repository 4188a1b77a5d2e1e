"""Evaluation of (compressed) models: the perplexity of causal language models."""
from .perplexity import DEFAULT_MAX_SEQ_LEN, Perplexity, perplexity

__all__ = ["perplexity", "Perplexity", "DEFAULT_MAX_SEQ_LEN"]
