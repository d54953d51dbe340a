"""``routing/modelcatalog.py``: a server's ``/v1/models`` answer parsed within bounds, and
the models each group serves (configured, or the union of its servers' last good lists)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from muxproxy.config import Config, Route, Server, Upstream, quick_config
from muxproxy.routing.modelcatalog import (
    MAX_BODY,
    MAX_CREATED,
    OWNER,
    ModelCatalog,
    ModelInfo,
    ModelListError,
    parse_model_list,
)


def listing(*entries: object) -> bytes:
    return json.dumps({"object": "list", "data": list(entries)}).encode()


def test_a_vllm_answer_gives_its_models_and_adapters_in_order() -> None:
    body = listing(
        {"id": "llama-3.1-8b", "object": "model", "created": 1700000000, "owned_by": "vllm"},
        {"id": "sql-lora", "object": "model", "created": 1700000001, "owned_by": "vllm"},
    )
    assert parse_model_list(body) == (
        ModelInfo(id="llama-3.1-8b", created=1700000000, owned_by="vllm"),
        ModelInfo(id="sql-lora", created=1700000001, owned_by="vllm"),
    )


def test_duplicates_are_listed_once_and_insane_fields_get_defaults() -> None:
    body = listing(
        {"id": "m"},
        {"id": "m", "owned_by": "other"},
        {"id": "n", "created": True, "owned_by": ""},
        {"id": "o", "created": -5, "owned_by": "x" * 65},
        {"id": "p", "created": 10**30, "owned_by": 3},
    )
    assert parse_model_list(body) == (
        ModelInfo(id="m"),
        ModelInfo(id="n", created=0, owned_by=OWNER),
        ModelInfo(id="o", created=0, owned_by=OWNER),
        ModelInfo(id="p", created=MAX_CREATED, owned_by=OWNER),
    )


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"\xff\xfe",
        b"[" * 100_000 + b"]" * 100_000,  # past the parser's recursion limit
        b'{"data": [' + b"1" * 5000 + b"]}",  # an integer too long to convert
        b"[]",
        b'{"object": "list"}',
        b'{"data": {}}',
        b'{"data": [1]}',
        b'{"data": [{"id": 7}]}',
        b'{"data": [{"id": ""}]}',
        listing({"id": "x" * 257}),
        listing(*({"id": f"m{i}"} for i in range(1025))),
        b" " * (MAX_BODY + 1),
    ],
)
def test_anything_but_a_model_list_within_bounds_is_a_model_list_error(body: bytes) -> None:
    with pytest.raises(ModelListError):
        parse_model_list(body)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(body=st.binary(max_size=512))
def test_arbitrary_bytes_give_a_list_or_a_model_list_error(body: bytes) -> None:
    try:
        parse_model_list(body)
    except ModelListError:
        pass


@settings(max_examples=100, deadline=None)
@given(entries=st.lists(st.dictionaries(st.sampled_from(["id", "created", "owned_by"]), JSON)))
def test_arbitrary_entries_give_sane_models_or_a_model_list_error(entries: list[object]) -> None:
    try:
        models = parse_model_list(listing(*entries))
    except ModelListError:
        return
    for model in models:
        assert 0 < len(model.id) <= 256 and 0 <= model.created <= MAX_CREATED
        assert isinstance(model.owned_by, str) and 0 < len(model.owned_by) <= 64
    assert len({m.id for m in models}) == len(models)


def group(name: str, *servers: str, models: tuple[str, ...] = (), learn: bool = False) -> Upstream:
    return Upstream(
        name=name,
        servers=tuple(Server(address=s) for s in servers),
        models=models,
        learn_models=learn,
    )


def config_of(*groups: Upstream) -> Config:
    base = quick_config("127.0.0.1:0", ["127.0.0.1:1"])
    return Config(
        listeners=base.listeners,
        upstreams={g.name: g for g in groups},
        routes=(Route(prefix="/", upstream=groups[0].name),),
    )


def test_a_learning_group_serves_the_union_of_its_servers_last_good_lists() -> None:
    catalog = ModelCatalog()
    gpus = group("gpus", "10.0.0.1:8000", "10.0.0.2:8000", learn=True)
    assert catalog.served(gpus) == ()
    assert catalog.learnt("gpus", "10.0.0.1:8000", (ModelInfo(id="a"), ModelInfo(id="b")), 1.0)
    assert catalog.learnt("gpus", "10.0.0.2:8000", (ModelInfo(id="b"), ModelInfo(id="c")), 1.0)
    assert [m.id for m in catalog.served(gpus)] == ["a", "b", "c"]
    catalog.failed("gpus", "10.0.0.1:8000", "status 500", 2.0)  # its last good list stands
    assert [m.id for m in catalog.served(gpus)] == ["a", "b", "c"]
    assert not catalog.learnt("gpus", "10.0.0.2:8000", (ModelInfo(id="b"), ModelInfo(id="c")), 3)
    status = catalog.status(gpus, 5.0)
    assert status["source"] == "learnt"
    assert status["servers"] == {
        "10.0.0.1:8000": {
            "models": ["a", "b"],
            "age": 4.0,
            "last_error": "status 500",
            "error_age": 3.0,
        },
        "10.0.0.2:8000": {"models": ["b", "c"], "age": 2.0, "last_error": None, "error_age": None},
    }


def test_a_success_after_a_failure_clears_the_error() -> None:
    catalog = ModelCatalog()
    catalog.failed("g", "h:1", "timeout", 1.0)
    catalog.learnt("g", "h:1", (ModelInfo(id="a"),), 2.0)
    assert catalog.servers[("g", "h:1")].error is None


def test_configured_models_win_and_the_union_lists_each_name_once_then_aliases() -> None:
    catalog = ModelCatalog()
    listed = group("listed", "10.0.0.9:8000", models=("x", "y"))
    catalog.learnt("listed", "10.0.0.9:8000", (ModelInfo(id="ignored"),), 1.0)
    learning = group("learning", "10.0.0.1:8000", learn=True)
    catalog.learnt("learning", "10.0.0.1:8000", (ModelInfo(id="y"), ModelInfo(id="z")), 1.0)
    known = catalog.known([listed, learning], ["chat-default", "x"])
    assert [m.id for m in known] == ["x", "y", "z", "chat-default"]
    assert catalog.status(listed, 2.0) == {"source": "configured", "models": ["x", "y"]}
    assert catalog.status(group("plain", "10.0.0.3:80"), 2.0) == {"source": "none", "models": []}


def test_a_new_configuration_forgets_the_servers_it_no_longer_names() -> None:
    catalog = ModelCatalog()
    catalog.learnt("gpus", "10.0.0.1:8000", (ModelInfo(id="a"),), 1.0)
    catalog.learnt("gpus", "10.0.0.2:8000", (ModelInfo(id="b"),), 1.0)
    catalog.learnt("gone", "10.0.0.3:8000", (ModelInfo(id="c"),), 1.0)
    catalog.retain(config_of(group("gpus", "10.0.0.2:8000", learn=True)))
    assert list(catalog.servers) == [("gpus", "10.0.0.2:8000")]
