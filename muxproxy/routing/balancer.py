"""Choosing a backend among a group's servers.

Pure and deterministic: no clock, no randomness, no I/O, so every replica of the proxy that
sees the same sequence of requests makes the same choices, and tests need no mocks.
"""

from __future__ import annotations


class RoundRobin:
    """Plain round-robin over ``count`` servers."""

    def __init__(self, count: int) -> None:
        if count <= 0:
            raise ValueError("a group needs at least one server")
        self.count = count
        self._next = 0

    def pick(self) -> int:
        index = self._next
        self._next = (index + 1) % self.count
        return index
