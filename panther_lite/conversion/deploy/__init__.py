"""Deployment: freezing sketched layers into pairs of standard layers, and spotting sketched
layers a quantizer skipped."""
