"""Routing policies: pure code, no I/O, time passed in."""
