"""W3C Trace Context in the core (``muxproxy.core.observe.tracecontext``): the client's
``traceparent`` read, the backend's written, the access record's trace fields."""

from __future__ import annotations

import attrs
import pytest
from playbook import Playbook, default_config
from test_access import access, exchange

from muxproxy.config.telemetry import TelemetrySettings
from muxproxy.core.observe.tracecontext import (
    MAX_TRACESTATE,
    parse_traceparent,
    trace_context,
    with_traceparent,
)

CLIENT_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN = "00f067aa0ba902b7"
CLIENT_PARENT = f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01"


def traced_playbook(ratio: float = 1.0) -> Playbook:
    telemetry = TelemetrySettings(otlp_endpoint="http://127.0.0.1:4318", sample_ratio=ratio)
    return Playbook(attrs.evolve(default_config(), telemetry=telemetry))


def fields_named(headers: list[tuple[bytes, bytes]], name: bytes) -> list[bytes]:
    return [value for field, value in headers if field == name]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (CLIENT_PARENT, (CLIENT_TRACE, CLIENT_SPAN, True)),
        (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-00", (CLIENT_TRACE, CLIENT_SPAN, False)),
        (f" 00-{CLIENT_TRACE}-{CLIENT_SPAN}-03 ", (CLIENT_TRACE, CLIENT_SPAN, True)),
        # §3.2.4: a later version is read by its first four fields.
        (f"01-{CLIENT_TRACE}-{CLIENT_SPAN}-01-more", (CLIENT_TRACE, CLIENT_SPAN, True)),
        (f"ff-{CLIENT_TRACE}-{CLIENT_SPAN}-01", None),
        (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01-more", None),  # version 00 has four fields
        (f"00-{'0' * 32}-{CLIENT_SPAN}-01", None),
        (f"00-{CLIENT_TRACE}-{'0' * 16}-01", None),
        (f"00-{CLIENT_TRACE.upper()}-{CLIENT_SPAN}-01", None),
        (f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-0g", None),
        (f"00-{CLIENT_TRACE}x{CLIENT_SPAN}-01", None),
        (f"00-{CLIENT_TRACE[:-1]}-{CLIENT_SPAN}0-01", None),
        ("", None),
    ],
)
def test_traceparent_is_read_as_the_w3c_grammar_says(
    value: str, expected: tuple[str, str, bool] | None
) -> None:
    assert parse_traceparent(value.encode()) == expected


def test_a_valid_parent_is_continued_with_its_state() -> None:
    headers = [
        (b"traceparent", CLIENT_PARENT.encode()),
        (b"tracestate", b"a=1"),
        (b"tracestate", b"b=2"),
    ]
    context = trace_context(headers, prefix=b"0123456789ab", ident=7, ratio=0.0)
    assert (context.trace_id, context.parent_span_id) == (CLIENT_TRACE, CLIENT_SPAN)
    assert context.sampled  # the parent's flag wins over the ratio
    assert context.span_id != CLIENT_SPAN and len(context.span_id) == 16
    assert context.traceparent == f"00-{CLIENT_TRACE}-{context.span_id}-01".encode()
    out = with_traceparent([*headers, (b"x", b"y")], context)
    assert out == [(b"x", b"y"), (b"traceparent", context.traceparent), (b"tracestate", b"a=1,b=2")]


def test_an_invalid_or_repeated_parent_starts_a_new_trace_without_its_state() -> None:
    for headers in (
        [(b"traceparent", b"garbage"), (b"tracestate", b"a=1")],
        [(b"traceparent", CLIENT_PARENT.encode())] * 2,
    ):
        context = trace_context(headers, prefix=b"p", ident=1, ratio=1.0)
        assert context.trace_id != CLIENT_TRACE and context.parent_span_id is None
        assert context.tracestate is None and context.sampled


def test_an_oversized_tracestate_is_dropped_not_cut() -> None:
    headers = [
        (b"traceparent", CLIENT_PARENT.encode()),
        (b"tracestate", b"a=" + b"x" * MAX_TRACESTATE),
    ]
    assert trace_context(headers, prefix=b"p", ident=1, ratio=1.0).tracestate is None


def test_ids_are_derived_per_exchange_and_the_ratio_samples_new_traces() -> None:
    contexts = [trace_context([], prefix=b"p", ident=i, ratio=0.5) for i in range(400)]
    assert len({c.trace_id for c in contexts}) == len({c.span_id for c in contexts}) == 400
    assert trace_context([], prefix=b"p", ident=3, ratio=0.5) == contexts[3]  # no randomness
    assert trace_context([], prefix=b"q", ident=3, ratio=0.5) != contexts[3]
    sampled = sum(c.sampled for c in contexts)
    assert 140 < sampled < 260  # a 50 % ratio, over 400 derived ids
    assert not any(trace_context([], prefix=b"p", ident=i, ratio=0.0).sampled for i in range(50))


def test_the_backend_gets_the_proxy_span_as_parent_and_the_record_names_it() -> None:
    pb = traced_playbook()
    headers = [("traceparent", CLIENT_PARENT), ("tracestate", "vendor=1")]
    request, _ = exchange(pb, headers=headers, body=b'{"model":"m1"}', model_read=True)
    (sent,) = fields_named(request.headers, b"traceparent")
    fields = access(pb)
    assert fields["model"] == "m1" and fields["served_model"] is None  # the span names it
    assert fields["trace_id"] == CLIENT_TRACE and fields["parent_span_id"] == CLIENT_SPAN
    assert sent == f"00-{CLIENT_TRACE}-{fields['span_id']}-01".encode()
    assert fields["trace_sampled"] is True
    assert fields_named(request.headers, b"tracestate") == [b"vendor=1"]


def test_a_request_without_a_parent_starts_a_trace_the_backend_continues() -> None:
    pb = traced_playbook(ratio=0.0)
    request, _ = exchange(pb, model_read=True)
    (sent,) = fields_named(request.headers, b"traceparent")
    fields = access(pb)
    assert fields["parent_span_id"] is None and fields["trace_sampled"] is False
    assert sent == f"00-{fields['trace_id']}-{fields['span_id']}-00".encode()


def test_without_telemetry_the_client_traceparent_passes_untouched_and_unrecorded() -> None:
    pb = Playbook()
    request, _ = exchange(pb, headers=[("traceparent", CLIENT_PARENT)])
    assert fields_named(request.headers, b"traceparent") == [CLIENT_PARENT.encode()]
    assert "trace_id" not in access(pb) and "span_id" not in access(pb)
