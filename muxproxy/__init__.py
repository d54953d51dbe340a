"""muxproxy: an edge proxy for LLM inference fleets.

The sans-IO core is :class:`ProxyCore`: feed it events (``muxproxy.core.events``), carry out the
commands it returns (``muxproxy.core.commands``). It never raises for anything a peer sends —
bad input becomes a response, a reset or a GOAWAY — so an exception out of ``handle`` is a bug.
The Trio driver that runs it on real sockets is :class:`muxproxy.trio.server.ProxyServer`
(imported from there, so that ``import muxproxy`` does not start an event-loop library).

:func:`load_config` raises :class:`ConfigError` listing every problem of a configuration file.
"""

from muxproxy.config import Config, ConfigError, load_config, parse_config, quick_config
from muxproxy.core import commands, events
from muxproxy.core.proxy import ProxyCore
from muxproxy.core.statistics import ProxyStatistics, StreamStatistics

__all__ = [
    "Config",
    "ConfigError",
    "ProxyCore",
    "ProxyStatistics",
    "StreamStatistics",
    "commands",
    "events",
    "load_config",
    "parse_config",
    "quick_config",
]

__version__ = "0.1.0"
