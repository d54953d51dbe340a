"""atheris target: a backend's load report (its /metrics body) through ``parse_load_report``.

python fuzz/fuzz_load_report.py /tmp/work fuzz/corpus/load_report -max_total_time=300

The body is what any backend may send to a load poll (``core/upstream/loadpoll.py``): a peer's input
like the others. The invariants are ``harness.check_report``'s.
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with atheris.instrument_imports():
    import prometheus_client.parser  # noqa: F401 - instrumented so coverage guides the fuzzer

    import muxproxy.routing.loadreport  # noqa: F401

from fuzz.harness import check_report

if __name__ == "__main__":
    atheris.Setup(sys.argv, check_report)
    atheris.Fuzz()
