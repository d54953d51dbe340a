"""Choosing a backend among a group's servers.

Obeys the routing rules: pure code, standard library and attrs only (no trio, asyncio,
socket, ssl, select, time, random), no clock, no randomness, no I/O. Why: every replica of the
proxy that sees the same requests makes the same choices, hashing agrees across processes
(blake2b, never Python's salted ``hash()``), and tests need no mocks.

Indices refer to positions in a group's ``servers`` tuple. Weights are passed in on every call
rather than stored, so a weight changed at runtime applies to the very next decision; a weight
of 0 or less means "draining": never chosen for new work.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Sequence

__all__ = [
    "SmoothWeightedRoundRobin",
    "least_streams",
    "rendezvous_order",
]


class SmoothWeightedRoundRobin:
    """nginx's smooth weighted round-robin (``ngx_http_upstream_get_peer``).

    Each pick adds every eligible server's weight to its current value, picks the largest
    (lowest index on ties) and subtracts the total of the eligible weights from it. Weights
    5, 1, 1 give ``a a b a c a a``: the heavy server's picks are spread out, not bunched.
    """

    __slots__ = ("_current",)

    def __init__(self, size: int) -> None:
        self._current = [0] * size

    @property
    def size(self) -> int:
        return len(self._current)

    def carry(self, old: SmoothWeightedRoundRobin, moves: Iterable[tuple[int, int]]) -> None:
        """Take over ``old``'s current values of the servers that ``moves`` maps here
        (``(old index, new index)`` pairs): a reload keeps the kept servers' positions in
        the cycle; the values need not sum to 0 then, which the next picks even out."""
        for before, after in moves:
            self._current[after] = old._current[before]

    def pick(self, weights: Sequence[int], eligible: Iterable[int]) -> int | None:
        """The server to use now, or None if no eligible server has a weight above 0.

        ``weights`` is read on every call (runtime changes apply at once); ``eligible`` holds
        distinct indices into it. If ``len(weights)`` differs from the size, the state is
        reset to that size (the indices no longer mean the same servers).
        """
        current = self._current
        if len(weights) != len(current):
            current = self._current = [0] * len(weights)
        best = -1
        best_value = 0
        total = 0
        for index in eligible:
            weight = weights[index]
            if weight <= 0:
                continue
            value = current[index] + weight
            current[index] = value
            total += weight
            if best < 0 or value > best_value or (value == best_value and index < best):
                best = index
                best_value = value
        if best < 0:
            return None
        current[best] = best_value - total
        return best


def least_streams(
    weights: Sequence[int],
    active: Sequence[int],
    eligible: Iterable[int],
    rr: SmoothWeightedRoundRobin,
) -> int | None:
    """The eligible server with the fewest active streams relative to its weight.

    ``active[i] / weights[i]`` is compared without floats (``a_i * w_j < a_j * w_i``); servers
    with weight <= 0 are never picked. Ties are broken by ``rr`` among the tied servers, so
    an idle fleet is used in smooth weighted round-robin order. None if nothing is eligible.
    """
    tied: list[int] = []
    best_active = 0
    best_weight = 1
    for index in eligible:
        weight = weights[index]
        if weight <= 0:
            continue
        streams = active[index]
        if not tied:
            tied.append(index)
            best_active, best_weight = streams, weight
            continue
        lhs = streams * best_weight
        rhs = best_active * weight
        if lhs < rhs:
            tied = [index]
            best_active, best_weight = streams, weight
        elif lhs == rhs:
            tied.append(index)
    if not tied:
        return None
    if len(tied) == 1:
        return tied[0]
    return rr.pick(weights, tied)


_TWO_52 = float(1 << 52)


def rendezvous_order(
    key: bytes,
    ids: Sequence[bytes],
    weights: Sequence[int],
    eligible: Iterable[int],
) -> list[int]:
    """Eligible servers (weight > 0) in weighted rendezvous (highest random weight) order.

    ``score_i = -weight_i / ln(u_i)`` with ``u_i`` in (0, 1) taken from
    ``blake2b(ids[i] + b"\\0" + key, digest_size=8)``; highest score first, lower index first
    on exact ties. Server ``i`` comes first for a share ``weight_i / sum(weights)`` of keys,
    and adding or removing a server only moves the keys that it gains or had.
    The first index is the owner; the rest are the fallbacks in order.
    """
    suffix = b"\0" + key
    blake2b = hashlib.blake2b
    log = math.log
    scored: list[tuple[float, int]] = []  # (-score, index): ascending is the order wanted
    for index in eligible:
        weight = weights[index]
        if weight <= 0:
            continue
        digest = blake2b(ids[index] + suffix, digest_size=8).digest()
        # The top 52 bits, centred in their interval: exactly representable, never 0 or 1.
        u = ((int.from_bytes(digest, "big") >> 12) + 0.5) / _TWO_52
        scored.append((weight / log(u), index))  # log(u) < 0, so this is -score
    scored.sort()
    return [index for _, index in scored]
