"""Trio's exception groups, unwrapped: what a nursery raised, as the exceptions inside it.

A nursery wraps what its tasks raised in (nested) ``BaseExceptionGroup``s; a process that
reports a failure, or tells a cancellation from an error, wants the leaves. Plain Python, no
Trio: ``muxproxy check`` and the processes' common parts load it too.
"""

from __future__ import annotations


def leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside (nested) exception groups, or ``[exc]``."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in leaves(inner)]
    return [exc]
