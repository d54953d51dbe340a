"""Configuration: attrs records the core reads, and TOML loading with validation.

Every record is frozen: a new configuration is a new object (``ConfigChanged``), never a
mutation under a running exchange. Durations are seconds (float), sizes bytes (int).

Loading: :func:`load_config` reads a TOML file, :func:`parse_config` validates an already
parsed table, :func:`parse_quick_config` validates the flag form of ``muxproxy serve``. All
three raise :class:`ConfigError`, which carries *every* problem found, each message naming
the key path and what was expected::

    upstreams.gpus.servers[1]: expected "host:port", got "localhost"
    timeouts.raed: unknown key; did you mean "read"?

The records themselves carry no validators: code may build them directly (tests do, with
port 0 and tiny timeouts); validation is the job of the loading functions.

Modules: :mod:`.records` (the records), :mod:`.loading` (files, :func:`quick_config`,
top-level sections, ``serve`` flags), :mod:`.upstreams` (one ``[upstreams.NAME]`` group),
:mod:`.logs` (``[log]``) and :mod:`.checker` (the problem-collecting machinery and value
checks). Import from here.
"""

from __future__ import annotations

from muxproxy.config.checker import address_problem
from muxproxy.config.fleet import FleetSettings, ResolverSettings, StoreErrorPolicy
from muxproxy.config.loading import (
    ConfigError,
    load_config,
    parse_config,
    parse_quick_config,
    quick_config,
)
from muxproxy.config.logsettings import LOG_FORMATS, LOG_LEVELS, LogSettings
from muxproxy.config.queue import AdmissionQueue
from muxproxy.config.records import (
    ADMIN_TOKEN_ENV,
    CONDITIONS,
    PROMPT_SOURCES,
    RESUME_CREDENTIALS,
    SOURCE_KINDS,
    AdminSettings,
    AffinityMode,
    Api,
    Balance,
    Config,
    GroupTimeouts,
    HeaderRule,
    HealthCheck,
    Limits,
    Listener,
    LoadReporting,
    NextUpstream,
    PrefixAffinity,
    RateLimit,
    Resume,
    Route,
    Server,
    SessionSource,
    Sticky,
    StickyCookie,
    Timeouts,
    Upstream,
)

__all__ = [
    "ADMIN_TOKEN_ENV",
    "CONDITIONS",
    "LOG_FORMATS",
    "LOG_LEVELS",
    "PROMPT_SOURCES",
    "RESUME_CREDENTIALS",
    "SOURCE_KINDS",
    "AdminSettings",
    "AdmissionQueue",
    "AffinityMode",
    "Api",
    "Balance",
    "Config",
    "ConfigError",
    "FleetSettings",
    "GroupTimeouts",
    "HeaderRule",
    "HealthCheck",
    "Limits",
    "Listener",
    "LoadReporting",
    "LogSettings",
    "NextUpstream",
    "PrefixAffinity",
    "RateLimit",
    "ResolverSettings",
    "Resume",
    "Route",
    "Server",
    "SessionSource",
    "Sticky",
    "StickyCookie",
    "StoreErrorPolicy",
    "Timeouts",
    "Upstream",
    "address_problem",
    "load_config",
    "parse_config",
    "parse_quick_config",
    "quick_config",
]
