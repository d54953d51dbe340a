"""atheris target: DNS answers over time through discovery's decision, into a live core.

python fuzz/fuzz_discovery.py /tmp/work fuzz/corpus/discovery -max_total_time=600

The bytes are a group's interval and up to 16 lookups, each some seconds after the last: A
and AAAA answers, SRV answers (any priority, weight, port, target), answers without records,
failures, with any TTL. The invariants are ``fleetcases.check_discovery``'s.
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with atheris.instrument_imports():
    import h11  # noqa: F401 - instrumented so coverage guides the fuzzer through it

    import muxproxy.core.proxy
    import muxproxy.fleet.discovery  # noqa: F401

from fuzz.fleetcases import check_discovery

if __name__ == "__main__":
    atheris.Setup(sys.argv, check_discovery)
    atheris.Fuzz()
