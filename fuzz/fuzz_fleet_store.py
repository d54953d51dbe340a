"""atheris target: what the fleet store (Redis) returns, through every parser of it.

python fuzz/fuzz_fleet_store.py /tmp/work fuzz/corpus/fleet_store -max_total_time=600

Byte 0 picks the parser (the state hash, the published state, a published batch of
sessions, the sessions' hash, the reservation script's reply, the announcement's, the
compare-and-set's); the rest is what the store sent. The invariants are
``fleetcases.check_store``'s: a valid value or the parser's documented error, nothing else.
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with atheris.instrument_imports():
    import muxproxy.config.runtime
    import muxproxy.fleet.budgets
    import muxproxy.fleet.sessions
    import muxproxy.fleet.state  # noqa: F401

from fuzz.fleetcases import check_store

if __name__ == "__main__":
    atheris.Setup(sys.argv, check_store)
    atheris.Fuzz()
