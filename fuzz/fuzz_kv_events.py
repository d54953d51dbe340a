"""atheris target: what an engine sends on its KV-cache event stream and to ``/tokenize``.

python fuzz/fuzz_kv_events.py /tmp/work fuzz/corpus/kv_events -max_total_time=600

Three inputs, chosen by the first byte (``kvcases.py``): the bytes of a ZeroMQ stream from a
publisher (ZMTP 3.0's greeting, READY and frames: ``trio/zmtp.py``), each message read into
an engine's feed; one message's batch (vLLM's MessagePack: ``routing/kvwire.py``) straight
into a feed; or a ``/tokenize`` answer (``routing/kvtokens.py``). The invariants are
``kvcases.check``'s.
"""

from __future__ import annotations

import os
import sys

import atheris

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

with atheris.instrument_imports():
    import muxproxy.routing.kvfeed
    import muxproxy.routing.kvindex
    import muxproxy.routing.kvtokens
    import muxproxy.routing.kvwire
    import muxproxy.trio.zmtp  # noqa: F401 - instrumented so coverage guides the fuzzer

from fuzz.kvcases import check

if __name__ == "__main__":
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()
