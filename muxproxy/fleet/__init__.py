"""The fleet: what many replicas (and the workers of each) must agree on, as pure code.

Sans-IO like :mod:`muxproxy.core` and :mod:`muxproxy.routing`: no Trio, no sockets, no clock.
The decisions live here (a DNS answer against the servers known, a versioned runtime state
against the one applied, a budget's reservation); the lookups and the store's round trips are
:mod:`muxproxy.trio`'s. ``docs/fleet.md`` says what is shared and what stays per replica.
"""
