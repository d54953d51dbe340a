"""atheris target: backend h2 bytes through the sans-IO core (see harness.py for the invariants).

python fuzz/fuzz_backend_h2.py fuzz/corpus/backend_h2 -max_total_time=300
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with atheris.instrument_imports():
    import h2  # noqa: F401 - instrumented so coverage guides the fuzzer through it
    import h11  # noqa: F401

    import muxproxy.core.proxy  # noqa: F401

from fuzz.harness import decode, fleet_of, llm_of, run_case, stop_of


def test_one_input(buf: bytes) -> None:
    data, splits = decode(buf)
    run_case("backend_h2", data, splits, stop=stop_of(buf), llm=llm_of(buf), fleet=fleet_of(buf))


if __name__ == "__main__":
    atheris.Setup(sys.argv, test_one_input)
    atheris.Fuzz()
