"""LoRA adapters (``muxproxy.routing.lora``): vLLM's ``lora_requests_info`` read from a
``/metrics`` page (the newest sample; malformed lines leave the adapters unknown and the load
report as read), and where a request naming an adapter goes: a server holding it, then one
with a free slot, then the least loaded, never one over its bound."""

from __future__ import annotations

import time

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Gauge, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics
from prometheus_client.parser import text_string_to_metric_families

from muxproxy.config import LoadReporting, PrefixAffinity, Server, Upstream
from muxproxy.routing.llmrequest import MAX_MODEL, read_request
from muxproxy.routing.load import Ticket
from muxproxy.routing.loadreport import LoadReport, parse_load_report
from muxproxy.routing.lora import (
    MAX_ADAPTERS,
    MAX_LORA_LINE,
    LoraReport,
    is_adapter,
    lora_order,
    read_lora,
)
from muxproxy.routing.router import GroupRouter

GAUGES = (
    '# TYPE vllm:num_requests_running gauge\nvllm:num_requests_running{model_name="base"} 1\n'
    '# TYPE vllm:num_requests_waiting gauge\nvllm:num_requests_waiting{model_name="base"} 0\n'
)


def info(running: str, waiting: str = "", max_lora: str = "4", value: str = "1.7e9") -> str:
    labels = (
        f'max_lora="{max_lora}",running_lora_adapters="{running}",waiting_lora_adapters="{waiting}"'
    )
    return f"vllm:lora_requests_info{{{labels}}} {value}\n"


def lora_of(text: str) -> LoraReport | None:
    return read_lora(text, text_string_to_metric_families)


# -- reading ----------------------------------------------------------------------------------


def test_the_newest_sample_is_the_engine_now() -> None:
    page = info("a,b", "c", value="1700000010") + info("z", value="1700000020") + info("y")
    assert lora_of(page) == LoraReport(loaded=frozenset({"z"}), max_lora=4)


def test_running_and_waiting_adapters_are_both_held() -> None:
    lora = lora_of(info(" a , b,", "c,a", max_lora="3"))
    assert lora == LoraReport(loaded=frozenset({"a", "b", "c"}), max_lora=3)
    assert lora is not None and not lora.free
    assert LoraReport(loaded=frozenset({"a"}), max_lora=2).free
    assert not LoraReport(loaded=frozenset(), max_lora=None).free


def test_a_page_prometheus_client_writes_is_read_in_both_formats() -> None:
    """As vLLM sets it: ``set_to_current_time`` on each new label set, the old ones kept."""
    registry = CollectorRegistry()
    names = ["max_lora", "waiting_lora_adapters", "running_lora_adapters"]
    gauge = Gauge("vllm:lora_requests_info", "Running stats on lora requests.", names,
                  registry=registry)  # fmt: skip
    gauge.labels("2", "", "old").set(time.time() - 60)
    gauge.labels("2", "w", "new,other").set(time.time())
    expected = LoraReport(loaded=frozenset({"new", "other", "w"}), max_lora=2)
    assert lora_of(generate_latest(registry).decode()) == expected
    openmetrics = generate_openmetrics(registry).decode()
    assert "vllm_lora_requests_info{" in openmetrics  # the colon written as "_"
    assert lora_of(openmetrics) == expected


def test_a_sample_with_a_timestamp_is_read_by_its_value() -> None:
    page = info("old", value="5 9999999999999") + info("new", value="6 1")
    assert lora_of(page) == LoraReport(loaded=frozenset({"new"}), max_lora=4)


def test_a_label_value_holding_a_brace_does_not_hide_the_value() -> None:
    page = info("a}b", value="2") + info("c", value="1")
    assert lora_of(page) == LoraReport(loaded=frozenset({"a}b"}), max_lora=4)


def test_only_sample_lines_of_the_gauge_itself_are_read() -> None:
    newer = info("other", value="9")
    lines = [
        "  \t" + info("kept", value="2"),  # blanks before a name are allowed
        "x" + newer,  # another metric's name
        "# HELP " + newer,  # a comment
        newer[len("vllm:") :],  # no prefix, at the start of the page
        'sglang:lora_requests_info{running_lora_adapters="s"} 9\n',
    ]
    assert lora_of(lines[-2] + "".join(lines)) == LoraReport(loaded=frozenset({"kept"}), max_lora=4)
    assert lora_of(info("last", value="3").rstrip("\n")) == LoraReport(  # no final line feed
        loaded=frozenset({"last"}), max_lora=4
    )


def test_samples_without_a_finite_value_are_passed_over() -> None:
    page = info("nan", value="NaN") + info("inf", value="+Inf") + info("ok", value="1")
    page += info("bad", value="x") + 'vllm:lora_requests_info{max_lora="4"}\n'
    assert lora_of(page) == LoraReport(loaded=frozenset({"ok"}), max_lora=4)


def test_malformed_newest_lines_leave_the_adapters_unknown() -> None:
    older = info("older", value="1")
    assert lora_of(older + 'vllm:lora_requests_info{running_lora_adapters="a} 2\n') is None
    assert lora_of(older + 'vllm:lora_requests_info{max_lora="4"} 2\n') is None  # no adapters
    assert lora_of(older + info("a" * MAX_LORA_LINE, value="2")) is None
    many = ",".join(f"a{n}" for n in range(MAX_ADAPTERS + 1))
    assert lora_of(older + info(many, value="2")) is None
    assert lora_of("") is None
    assert lora_of("vllm:lora_requests_info 17\n") is None  # no labels: says nothing


def test_a_max_lora_that_is_no_count_is_not_said() -> None:
    for slots in ("", "four", "-1", "1.5", "1" * 7, "²"):
        assert lora_of(info("a", max_lora=slots)) == LoraReport(
            loaded=frozenset({"a"}), max_lora=None
        )


def test_the_load_report_carries_the_adapters_and_the_served_model() -> None:
    report = parse_load_report((GAUGES + info("a", "b", max_lora="2")).encode())
    assert report == LoadReport(
        running=1,
        waiting=0,
        kv_cache=None,
        engine="vllm",
        lora=LoraReport(loaded=frozenset({"a", "b"}), max_lora=2),
        models=frozenset({"base"}),
    )


def test_an_unreadable_lora_line_leaves_the_rest_of_the_report() -> None:
    body = GAUGES + 'vllm:lora_requests_info{running_lora_adapters="a\\"} 1\n'
    report = parse_load_report(body.encode())
    assert (report.running, report.waiting, report.lora) == (1, 0, None)


def test_many_lora_samples_do_not_count_against_the_gauge_lines() -> None:
    """A long-running engine keeps every label set it ever reported."""
    page = GAUGES + "".join(info(f"a{n}", value=str(n)) for n in range(5000))
    report = parse_load_report(page.encode())
    assert report.lora == LoraReport(loaded=frozenset({"a4999"}), max_lora=4)


def test_sglang_reports_no_adapters() -> None:
    body = "sglang:num_running_reqs 3\n" + info("a")
    assert parse_load_report(body.encode()).lora is None


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet='vlm_:orequstinfa{}="\\, .0123456789e\nNI+-x', max_size=400))
def test_read_lora_never_raises(text: str) -> None:
    lora = lora_of("vllm:lora_requests_info{" + text)
    assert lora is None or len(lora.loaded) <= MAX_ADAPTERS


# -- the request's model ------------------------------------------------------------------------


def test_the_request_names_its_model() -> None:
    assert read_request({"model": "sql-lora"}).model == "sql-lora"
    for bad in (None, 3, "", ["a"], "m" * (MAX_MODEL + 1)):
        assert read_request({"model": bad}).model is None
    assert read_request({"model": "m" * MAX_MODEL}).model == "m" * MAX_MODEL


# -- which names are adapters -----------------------------------------------------------------

HELD = LoraReport(loaded=frozenset({"x"}), max_lora=2)
BASE = frozenset({"base"})


def test_a_name_a_server_holds_is_an_adapter() -> None:
    assert is_adapter("x", [None, HELD], [frozenset(), frozenset()])


def test_a_name_no_server_holds_is_a_new_adapter_unless_it_is_the_base_model() -> None:
    assert is_adapter("new", [HELD, None], [BASE, frozenset()])
    assert not is_adapter("base", [HELD, None], [BASE, frozenset()])


def test_without_lora_slots_or_a_base_name_nothing_else_is_an_adapter() -> None:
    no_slots = LoraReport(loaded=frozenset({"x"}), max_lora=None)
    assert not is_adapter("new", [no_slots], [BASE])  # LoRA slots unknown
    assert not is_adapter("new", [HELD], [frozenset()])  # the base model's name unknown
    assert not is_adapter("new", [None, None], [BASE, BASE])  # no LoRA reported


# -- the order --------------------------------------------------------------------------------


def test_held_then_free_slot_then_least_loaded() -> None:
    loras = [
        LoraReport(loaded=frozenset({"y"}), max_lora=1),  # 0: full, other adapter
        LoraReport(loaded=frozenset({"y"}), max_lora=2),  # 1: a free slot
        None,  # 2: says nothing
        LoraReport(loaded=frozenset({"x", "y"}), max_lora=2),  # 3: holds x
    ]
    loads = [5.0, 9.0, 1.0, 7.0]
    order = lora_order("x", [0, 1, 2, 3], loras, lambda i: True, loads.__getitem__)
    assert order == [3, 1, 2, 0]


def test_least_loaded_first_within_a_tier_and_the_groups_order_on_ties() -> None:
    loras = [HELD, HELD, HELD, HELD]
    loads = [3.0, 1.0, 1.0, 2.0]
    assert lora_order("x", [2, 0, 1, 3], loras, lambda i: True, loads.__getitem__) == [2, 1, 3, 0]


def test_a_server_over_its_bound_goes_last_even_holding_the_adapter() -> None:
    loras = [HELD, LoraReport(loaded=frozenset(), max_lora=1), None]
    order = lora_order("x", [0, 1, 2], loras, lambda i: i != 0, lambda i: 0.0)
    assert order == [1, 2, 0]


# -- a group's router ---------------------------------------------------------------------------

A, B, C = (f"10.0.0.{n}:8000" for n in range(1, 4))


def router(*servers: Server, load_factor: float = 1.25) -> GroupRouter:
    group = Upstream(
        name="g",
        servers=servers or tuple(Server(address=a) for a in (A, B, C)),
        load_report=LoadReporting(interval=1.0),
        prefix=PrefixAffinity(load_factor=load_factor),
    )
    return GroupRouter(group)


def reported(r: GroupRouter, address: str, held: set[str], max_lora: int, now: float = 0.0) -> None:
    lora = LoraReport(loaded=frozenset(held), max_lora=max_lora)
    report = LoadReport(running=0, waiting=0, kv_cache=0.1, engine="vllm", lora=lora,
                        models=frozenset({"base"}))  # fmt: skip
    r.load_reported(r.by_address[address], report, now)


def first(r: GroupRouter, model: str | None, now: float = 0.0) -> str:
    return r.group.servers[r.candidates(None, None, now, model=model)[0]].address


def fleet() -> GroupRouter:
    r = router()
    reported(r, A, {"y"}, 1)  # full
    reported(r, B, {"x"}, 1)  # holds x, full
    reported(r, C, {"z"}, 2)  # a free slot
    return r


def test_router_sends_an_adapter_to_the_server_holding_it() -> None:
    r = fleet()
    assert [first(r, "x") for _ in range(6)] == [B] * 6
    assert [first(r, "y") for _ in range(6)] == [A] * 6


def test_router_sends_a_new_adapter_to_a_free_slot() -> None:
    r = fleet()
    assert [first(r, "new") for _ in range(6)] == [C] * 6


def test_router_sends_a_new_adapter_to_the_least_loaded_when_no_slot_is_free() -> None:
    r = fleet()
    reported(r, C, {"z", "w"}, 2)
    r.stream_started(r.by_address[A], None, 0.0, Ticket(100))
    r.stream_started(r.by_address[C], None, 0.0, Ticket(50))
    assert first(r, "new") == B
    r.stream_started(r.by_address[B], None, 0.0, Ticket(80))
    assert first(r, "new") == C


def test_base_model_requests_keep_the_groups_order() -> None:
    plain, lora = router(), fleet()
    expected = [first(plain, "base") for _ in range(6)]
    assert [first(lora, "base") for _ in range(6)] == expected
    unnamed = router()
    assert [first(unnamed, None) for _ in range(6)] == expected


def test_without_fresh_reports_every_name_keeps_the_groups_order() -> None:
    plain, stale = router(), fleet()
    later = 10.0  # past 3 intervals of 1 s
    expected = [first(plain, "x", later) for _ in range(6)]
    assert [first(stale, "x", later) for _ in range(6)] == expected
    assert len(set(expected)) == 3  # round-robin, not the holder


def test_a_hot_adapter_spills_past_the_bounded_loads_bound() -> None:
    r = fleet()
    holder = r.by_address[B]
    assert first(r, "x") == B
    r.stream_started(holder, None, 0.0)  # 1 + 1 streams > ceil(1.25 x 2 / 3) = 1
    assert first(r, "x") == C  # a free slot next
    for other in (A, C):
        r.stream_started(r.by_address[other], None, 0.0)  # 1 + 1 <= ceil(1.25 x 4 / 3) = 2
    assert first(r, "x") == B
    for _ in range(2):
        r.stream_started(holder, None, 0.0)  # 3 + 1 > ceil(1.25 x 6 / 3) = 3
    assert first(r, "x") == C


def test_a_full_server_is_not_chosen_for_the_adapter_it_holds() -> None:
    servers = (Server(address=A), Server(address=B, max_streams=1), Server(address=C))
    r = router(*servers, load_factor=10.0)  # the bounded-loads bound is not the reason
    reported(r, A, {"y"}, 1)
    reported(r, B, {"x"}, 1)
    reported(r, C, {"z"}, 2)
    r.stream_started(r.by_address[B], None, 0.0)
    order = r.candidates(None, None, 0.0, model="x")
    assert [r.group.servers[i].address for i in order] == [C, A, B]
