"""Load reports: a periodic ``GET <load_report.path>`` to every server of a group that asks
for them, read as the engine's own load and LoRA adapters (``routing/loadreport.py``,
``routing/lora.py``).

A ``LoadPoll`` is a probe (``probes.py``) of another kind: the same way to the server (a
pooled backend connection, as requests use), the same timers and the same states; what
differs is what it does with the answer. It reads the body, at most ``BODY_LIMIT`` bytes,
and hands the parsed report to the group's router, which uses it while it is fresh
(``routing/load.py``: at most 3 intervals old). A failure (no connection, a timeout, a
status other than 200, a body too large or not a Prometheus exposition with a known gauge)
degrades this one feature for this one server: the router's own counts stand alone once the
last report is stale, and nothing else is touched. The first result is logged
(``event=load_report``, ``ok``), and after it each change (a failure starting or ending),
not every poll. A load poll never changes a server's health.
"""

from __future__ import annotations

from muxproxy.config import LoadReporting, Upstream
from muxproxy.core.commands import Log
from muxproxy.core.effects import Effects
from muxproxy.core.ports import ProbeHost
from muxproxy.core.upstream.bodypoll import BodyPoll
from muxproxy.routing.loadreport import MAX_BODY, LoadReport, ReportError, parse_load_report, parser

BODY_LIMIT = MAX_BODY
"""Bytes of a report read at most, the parser's own bound (``loadreport.MAX_BODY``, 1 MiB):
vLLM's page is some 50-200 KiB (its histograms)."""


class LoadPoll(BodyPoll):
    WHAT = "report"
    USER_AGENT = b"muxproxy-load-report"

    def __init__(
        self, fx: Effects, host: ProbeHost, group: Upstream, index: int, ident: int
    ) -> None:
        super().__init__(fx, host, group, index, ident, body_limit=BODY_LIMIT)
        parser()  # imported now, with the configuration, rather than in the first poll
        self.report: LoadReport | None = None

    def _schedule_of(self, group: Upstream) -> tuple[bytes, float, float]:
        settings: LoadReporting | None = group.load_report
        assert settings is not None
        return settings.path.encode(), settings.interval, settings.poll_timeout

    def _read(self, body: bytes) -> str | None:
        try:
            self.report = parse_load_report(body)
        except ReportError as exc:
            return str(exc)
        return None

    def _result(self, ok: bool, detail: str) -> None:
        router = self.host.router(self.group)
        if ok:
            assert self.report is not None
            router.load_reported(self.index, self.report, self.fx.now)
            self.host.room_freed(router)  # a shorter engine queue may let who waits go
        if self.failing is None or ok == self.failing:  # the first result, or a change
            self.failing = not ok
            fields = {
                "upstream": self.group.name,
                "server": str(self.origin),
                "ok": ok,
                "detail": detail,
            }
            self.fx.emit(Log(event="load_report", fields=fields))
