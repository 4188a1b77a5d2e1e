"""The version of panther_lite (one place: the package, the command, the packaging and the
checkpoint fingerprints read it here)."""

__version__ = "0.2.0"
