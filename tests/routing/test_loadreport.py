"""An engine's load from its /metrics page (``muxproxy.routing.loadreport``): real vLLM and SGLang
pages, pages prometheus_client writes in both formats, bad values, and bodies that must give
ReportError and nothing else."""

from __future__ import annotations

import math
import pathlib
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from muxproxy.routing.loadreport import (
    MAX_BODY,
    MAX_LINE,
    MAX_SAMPLES,
    LoadReport,
    ReportError,
    parse_load_report,
)

DATA = pathlib.Path(__file__).resolve().parent / "data"
PAGES = ["vllm_v1_two_engines.txt", "vllm_v0.txt", "sglang_dp2.txt"]


def page(name: str) -> bytes:
    return (DATA / name).read_bytes()


def reason(body: bytes) -> str:
    with pytest.raises(ReportError) as caught:
        parse_load_report(body)
    assert isinstance(caught.value.args[0], str)
    return caught.value.args[0]


# -- real pages --------------------------------------------------------------------------------


@pytest.mark.parametrize("name", PAGES)
def test_fixture_pages_are_whole_valid_expositions(name: str) -> None:
    """The pages carry what a real one does around the gauges: histograms, counters."""
    families = list(text_string_to_metric_families(page(name).decode()))
    types = {family.type for family in families}
    assert {"gauge", "counter", "histogram"} <= types
    assert any(s.name.endswith("_bucket") for f in families for s in f.samples)


def test_vllm_v1_page_sums_the_engines_and_takes_the_fullest_cache() -> None:
    report = parse_load_report(page("vllm_v1_two_engines.txt"))
    # engine "0": 7 running, 2 waiting, 0.4375; engine "1": 5, 0, 0.61328125.
    assert report == LoadReport(
        running=12,
        waiting=2,
        kv_cache=0.61328125,
        engine="vllm",
        models=frozenset({"meta-llama/Llama-3.1-8B-Instruct"}),
    )


def test_vllm_before_v1_reads_the_older_kv_gauge() -> None:
    report = parse_load_report(page("vllm_v0.txt"))
    assert report == LoadReport(
        running=31,
        waiting=12,
        kv_cache=0.9871,
        engine="vllm",
        models=frozenset({"Qwen/Qwen2.5-7B-Instruct"}),
    )


def test_sglang_page_sums_the_data_parallel_ranks() -> None:
    report = parse_load_report(page("sglang_dp2.txt"))
    assert report == LoadReport(
        running=81,
        waiting=4,
        kv_cache=0.28,
        engine="sglang",
        models=frozenset({"meta-llama/Llama-3.1-70B-Instruct"}),
    )


def test_sglang_tensor_parallel_ranks_of_one_scheduler_count_once() -> None:
    """With --enable-metrics-for-all-schedulers every TP rank reports the same batch."""
    lines = []
    for dp in ("0", "1"):
        for tp in ("0", "1"):
            rank = f'dp_rank="{dp}",model_name="m",tp_rank="{tp}"'
            lines.append(f"sglang:num_running_reqs{{{rank}}} {10 + int(dp)}.0")
            lines.append(f"sglang:num_queue_reqs{{{rank}}} {2 * int(dp)}.0")
    report = parse_load_report("\n".join(lines).encode())
    assert (report.running, report.waiting) == (21, 2)


def vllm_registry() -> CollectorRegistry:
    """A registry shaped like vLLM's (it writes its page with prometheus_client)."""
    registry = CollectorRegistry()
    labels = ["model_name", "engine"]
    running = Gauge("vllm:num_requests_running", "Running.", labels, registry=registry)
    waiting = Gauge("vllm:num_requests_waiting", "Waiting.", labels, registry=registry)
    usage = Gauge("vllm:kv_cache_usage_perc", "KV-cache usage.", labels, registry=registry)
    prompt = Counter("vllm:prompt_tokens", "Prefill tokens.", labels, registry=registry)
    ttft = Histogram(
        "vllm:time_to_first_token_seconds", "TTFT.", labels, registry=registry, buckets=[0.1, 1.0]
    )
    for engine, (run, wait, kv) in enumerate([(3, 1, 0.25), (4, 0, 0.5), (0, 6, 0.125)]):
        name = ("my model", str(engine))
        running.labels(*name).set(run)
        waiting.labels(*name).set(wait)
        usage.labels(*name).set(kv)
        prompt.labels(*name).inc(100)
        ttft.labels(*name).observe(0.2)
    return registry


def test_prometheus_text_and_openmetrics_pages_give_the_same_report() -> None:
    registry = vllm_registry()
    text = generate_latest(registry)
    openmetrics = generate_openmetrics(registry)
    assert openmetrics.endswith(b"# EOF\n")
    # prometheus_client's OpenMetrics writer turns the samples' colons into underscores.
    assert b"\nvllm_num_requests_running{" in openmetrics
    expected = LoadReport(
        running=7, waiting=7, kv_cache=0.5, engine="vllm", models=frozenset({"my model"})
    )
    assert parse_load_report(text) == expected
    assert parse_load_report(openmetrics) == expected


def test_an_openmetrics_body_cut_before_its_eof_still_reports() -> None:
    body = generate_openmetrics(vllm_registry())
    assert parse_load_report(body[: body.index(b"# HELP vllm:prompt_tokens")]).running == 7


# -- which lines count -------------------------------------------------------------------------


def test_names_that_only_begin_like_a_gauge_are_not_read() -> None:
    body = (
        b'vllm:num_requests_waiting_by_reason{reason="capacity"} 9.0\n'
        b"vllm:num_requests_running_total 50\n"
        b"xvllm:num_requests_running 50\n"
        b"vllm:num_requests_running 2\n"
        b"vllm:num_requests_waiting 1\n"
    )
    assert parse_load_report(body) == LoadReport(running=2, waiting=1, kv_cache=None, engine="vllm")


def test_the_newer_vllm_kv_gauge_wins_over_the_older() -> None:
    body = b"vllm:gpu_cache_usage_perc 0.9\nvllm:kv_cache_usage_perc 0.3\n"
    assert parse_load_report(body).kv_cache == 0.3
    assert parse_load_report(b"vllm:gpu_cache_usage_perc 0.9\n").kv_cache == 0.9


def test_line_endings_whitespace_timestamps_and_escapes_are_read() -> None:
    body = (
        b'# HELP vllm:num_requests_running a "help" line\r\n'
        b'  vllm:num_requests_running{model_name="a \\"quoted\\" \\\\ name\\n"} 3 1700000000000\r\n'
        b'\tvllm:num_requests_running\t{engine = "1" , }\t4\r\n'
        b"vllm:num_requests_waiting 2e0\r\n"
    )
    report = parse_load_report(body)
    assert (report.running, report.waiting) == (7, 2)


def test_unrelated_broken_lines_do_not_spoil_the_report() -> None:
    broken = (
        b"weird{a=unquoted} 1\n{{{{{\nnot a metric at all\n# TYPE x nonsense\n\xf0\x9f\x98\x80 1\n"
    )
    body = broken + page("vllm_v1_two_engines.txt") + broken
    with pytest.raises(ValueError):  # the page as a whole does not parse
        list(text_string_to_metric_families(body.decode()))
    assert parse_load_report(body).running == 12


# -- values ------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["NaN", "+Inf", "-Inf", "-1", "-0.5"])
def test_a_bad_sample_makes_only_its_gauge_unknown(bad: str) -> None:
    body = (
        f'vllm:num_requests_running{{engine="0"}} 3\n'
        f'vllm:num_requests_running{{engine="1"}} {bad}\n'
        f"vllm:num_requests_waiting 5\n"
        f"vllm:kv_cache_usage_perc {bad}\n"
    ).encode()
    assert parse_load_report(body) == LoadReport(
        running=None, waiting=5, kv_cache=None, engine="vllm"
    )


def test_kv_cache_is_clamped_to_one_and_counts_are_rounded() -> None:
    body = b"sglang:token_usage 1.5\nsglang:num_running_reqs 2.6\nsglang:num_queue_reqs 0.4\n"
    assert parse_load_report(body) == LoadReport(
        running=3, waiting=0, kv_cache=1.0, engine="sglang"
    )


def test_huge_integer_values_are_exact_or_clamped_never_an_overflow() -> None:
    huge = "9" * 400  # beyond a float; the parser gives a Python int
    body = f"vllm:num_requests_running {huge}\nvllm:kv_cache_usage_perc {huge}\n".encode()
    report = parse_load_report(body)
    assert report.running == int(huge)
    assert report.kv_cache == 1.0
    assert parse_load_report(b"vllm:num_requests_running 1e999\n").running is None  # inf


# -- errors ------------------------------------------------------------------------------------


def test_bodies_without_a_report() -> None:
    assert reason(b"") == "no vllm or sglang load gauge"
    assert reason(b"<html><body>502 Bad Gateway</body></html>") == "no vllm or sglang load gauge"
    assert reason(b"# TYPE vllm:num_requests_running gauge\n") == "no vllm or sglang load gauge"
    assert reason(b"vllm:num_requests_running 1\n\xff\xfe\n") == "body is not UTF-8"
    mixed = b"vllm:num_requests_running 1\nsglang:num_running_reqs 1\n"
    assert reason(mixed) == "gauges of both vllm and sglang"


def test_a_broken_gauge_line_fails_the_whole_report() -> None:
    for line in [
        b"vllm:num_requests_running three",
        b'vllm:num_requests_running{engine="0} 1',
        b"vllm:num_requests_running{engine=0} 1",
        b'vllm:num_requests_running{engine="0",engine="1"} 1',
        b'vllm:num_requests_running{__name__="x"} 1',
        b"vllm:num_requests_running 1_000",
    ]:
        body = b"vllm:num_requests_waiting 1\n" + line + b"\n"
        assert reason(body) == "vllm:num_requests_running: unparseable sample line", line


def test_limits_on_body_line_and_sample_count() -> None:
    assert reason(b" " * (MAX_BODY + 1)) == f"body over {MAX_BODY} bytes"
    padded = b'sglang:token_usage{model_name="' + b"m" * MAX_LINE + b'"} 0.5\n'
    assert reason(padded) == f"sglang:token_usage: line over {MAX_LINE} characters"
    assert reason(b"sglang:token_usage 0.5\n" * (MAX_SAMPLES + 1)) == (
        f"over {MAX_SAMPLES} gauge lines"
    )
    assert parse_load_report(b"sglang:token_usage 0.5\n" * MAX_SAMPLES).kv_cache == 0.5


# -- fuzzing -----------------------------------------------------------------------------------


def report_or_error(body: bytes) -> LoadReport | None:
    """Whatever the body, a report or ReportError: any other exception fails the test."""
    try:
        return parse_load_report(body)
    except ReportError as error:
        assert error.args and isinstance(error.args[0], str)
        return None


@settings(max_examples=200, deadline=None)
@given(body=st.binary(max_size=512))
def test_random_bytes_give_a_report_or_report_error(body: bytes) -> None:
    report_or_error(body)


GAUGE_STARTS = (b"vllm:num_requests_", b"vllm:kv_", b"sglang:num_", b"sglang:token_")
TRICKY = [b"{", b"}", b'"', b"\\", b",", b"=", b"\n", b" ", b"\t", b"#", b":", b"_", b"e", b"\xff"]


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_mutated_real_pages_give_a_report_or_report_error(data: st.DataObject) -> None:
    text = bytearray(page(data.draw(st.sampled_from(PAGES))))
    gauge_lines = [i for i in range(len(text)) if text.startswith(GAUGE_STARTS, i)]
    for _ in range(data.draw(st.integers(1, 6))):
        # Mostly on a gauge line, where the parser reads.
        at = data.draw(st.sampled_from(gauge_lines)) + data.draw(st.integers(0, 80))
        at = min(at, len(text))
        op = data.draw(st.sampled_from(["replace", "cut", "insert"]))
        piece = data.draw(st.sampled_from(TRICKY) | st.binary(min_size=1, max_size=8))
        if op == "replace":
            text[at : at + len(piece)] = piece
        elif op == "cut":
            del text[at : at + data.draw(st.integers(1, 12))]
        else:
            text[at:at] = piece
    report_or_error(bytes(text))


@settings(max_examples=100, deadline=None)
@given(
    values=st.lists(
        st.tuples(st.text(max_size=20), st.integers(0, 10**6), st.floats(0, 1)),
        min_size=1,
        max_size=5,
        unique_by=lambda value: value[0],
    ),
    openmetrics=st.booleans(),
)
def test_any_label_values_prometheus_client_writes_are_read_back(
    values: list[tuple[str, int, float]], openmetrics: bool
) -> None:
    registry = CollectorRegistry()
    running = Gauge("sglang:num_running_reqs", "", ["model_name"], registry=registry)
    usage = Gauge("sglang:token_usage", "", ["model_name"], registry=registry)
    for model, count, fraction in values:
        running.labels(model).set(count)
        usage.labels(model).set(fraction)
    body = (generate_openmetrics if openmetrics else generate_latest)(registry)
    report = parse_load_report(body)
    assert report.running == sum(count for _, count, _ in values)
    assert report.kv_cache is not None
    assert math.isclose(report.kv_cache, max(fraction for *_, fraction in values))


PATHOLOGICAL = {
    "deep nesting": b"vllm:num_requests_running" + b"{" * 100_000 + b"} 1\n",
    "invalid escapes": b'vllm:num_requests_running{a="' + b"\\x\\q" * 200 + b'"} 1\n',
    "escaped quotes, the most the parser is given": (
        b'sglang:token_usage{a="' + b'\\"' * 495 + b'"} 0.5\n'
    )
    * MAX_SAMPLES,
    "a label per line, many lines": b"".join(
        b'vllm:num_requests_running{l%d="%d"} 1\n' % (n, n) for n in range(20_000)
    ),
    "200,000 labels on a comment": b"# HELP x " + b'a="",' * 200_000 + b"\n",
    "a megabyte of spaces on a comment": b"#" + b" " * (MAX_BODY - 40) + b"x\n",
    "200,000 labels on another metric": b"other{" + b'a="",' * 200_000 + b"} 1\n",
}
OUTCOMES: dict[str, LoadReport | str] = {
    "deep nesting": f"vllm:num_requests_running: line over {MAX_LINE} characters",
    "invalid escapes": LoadReport(running=1, waiting=None, kv_cache=None, engine="vllm"),
    "escaped quotes, the most the parser is given": LoadReport(
        running=None, waiting=None, kv_cache=0.5, engine="sglang"
    ),
    "a label per line, many lines": f"over {MAX_SAMPLES} gauge lines",
    "200,000 labels on a comment": "no vllm or sglang load gauge",
    "a megabyte of spaces on a comment": "no vllm or sglang load gauge",
    "200,000 labels on another metric": "no vllm or sglang load gauge",
}


@pytest.mark.parametrize("name", sorted(PATHOLOGICAL))
def test_pathological_bodies_are_cheap_and_give_report_error_or_a_report(name: str) -> None:
    body = PATHOLOGICAL[name]
    assert len(body) <= MAX_BODY
    started = time.perf_counter()
    try:
        outcome: LoadReport | str = parse_load_report(body)
    except ReportError as error:
        outcome = error.args[0]
    elapsed = time.perf_counter() - started
    assert outcome == OUTCOMES[name]
    # Unbounded, the parser takes 5 to 17 s on such a megabyte; bounded, about 0.1 s at worst
    # (the escaped quotes). The bound is loose for a busy machine.
    assert elapsed < 2.0
