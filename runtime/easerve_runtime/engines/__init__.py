"""Engines: the hardware side of a worker (see ``base.py`` for the protocol)."""
