"""muxproxy: an edge proxy for LLM inference fleets.

The sans-IO core lives in :mod:`muxproxy.core` (``ProxyCore.handle(event) -> list[Command]``);
the Trio driver that runs it on real sockets lives in :mod:`muxproxy.trio`.
"""

__version__ = "0.1.0"
