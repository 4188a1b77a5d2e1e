"""Saving: the conversion config (a converted layout as JSON, rebuilt in a fresh dense model),
save_pretrained / from_pretrained, and reading safetensors weight files."""
