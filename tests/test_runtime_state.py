"""Runtime server state (``muxproxy.config.runtime``): the records, the JSON document, the
atomic state file, and naming a server by address or by its opaque id."""

from __future__ import annotations

import json
import os
from pathlib import Path

import attrs
import pytest

from muxproxy.config import Config, Server, Sticky, StickyCookie, Upstream, quick_config
from muxproxy.config.runtime import (
    RuntimeState,
    ServerOverride,
    load_state,
    resolve_server,
    save_state,
)
from muxproxy.config.serverid import server_id

A, B = "10.0.0.1:8000", "10.0.0.2:8000"


def sample() -> RuntimeState:
    return (
        RuntimeState.empty()
        .changed("gpus", A, weight=3)
        .changed("gpus", B, drain=True)
        .changed("cpus", A, down=True, weight=0)
    )


def test_changed_sets_fields_and_a_reset_to_defaults_removes_the_entry() -> None:
    state = RuntimeState.empty().changed("gpus", A, weight=5)
    assert state.get("gpus", A) == ServerOverride(weight=5)
    state = state.changed("gpus", A, drain=True)
    assert state.get("gpus", A) == ServerOverride(weight=5, drain=True)
    assert state.get("gpus", B) == ServerOverride()
    state = state.changed("gpus", A, weight=None, drain=False)
    assert state == RuntimeState.empty()
    assert state.servers == {}


def test_changed_refuses_unknown_fields_and_bad_values_by_name() -> None:
    state = RuntimeState.empty()
    with pytest.raises(ValueError, match=r"^wieght: unknown field; expected one of weight"):
        state.changed("gpus", A, wieght=1)
    with pytest.raises(
        ValueError, match=r"^weight: expected an integer from 0 to 1000000 .* or null, got -1"
    ):
        state.changed("gpus", A, weight=-1)
    with pytest.raises(ValueError, match=r"^weight: expected .* got 1000001$"):
        state.changed("gpus", A, weight=10**6 + 1)
    with pytest.raises(ValueError, match=r"^weight: expected .* got an integer of 31 digits or"):
        state.changed("gpus", A, weight=10**330)
    assert state.changed("gpus", A, weight=10**6).get("gpus", A).weight == 10**6
    with pytest.raises(ValueError, match=r"^weight: .* got True"):
        state.changed("gpus", A, weight=True)
    with pytest.raises(ValueError, match=r"^drain: expected true or false, got 'yes'"):
        state.changed("gpus", A, drain="yes")
    with pytest.raises(ValueError, match=r"^down: expected true or false, got 1"):
        state.changed("gpus", A, down=1)


def test_json_round_trip_is_sorted_and_complete() -> None:
    state = sample()
    document = state.to_json()
    assert document == {
        "version": 1,
        "servers": [
            {"group": "cpus", "address": A, "weight": 0, "drain": False, "down": True},
            {"group": "gpus", "address": A, "weight": 3, "drain": False, "down": False},
            {"group": "gpus", "address": B, "weight": None, "drain": True, "down": False},
        ],
    }
    assert RuntimeState.from_json(json.loads(json.dumps(document))) == state


@pytest.mark.parametrize(
    ("document", "message"),
    [
        ([], "^expected a JSON object, got list"),
        ({"version": 2, "servers": []}, "^version: expected 1, got 2"),
        ({"servers": []}, "^version: expected 1, got None"),
        ({"version": 1, "servers": {}}, "^servers: expected an array, got dict"),
        ({"version": 1, "extra": 1}, "^extra: unknown key"),
        ({"version": 1, "servers": [3]}, r"^servers\[0\]: expected an object, got int"),
        (
            {"version": 1, "servers": [{"group": "g"}]},
            r"^servers\[0\]\.address: expected a non-empty string, got None",
        ),
        (
            {"version": 1, "servers": [{"group": "g", "address": A, "weight": "2"}]},
            r"^servers\[0\]\.weight: expected an integer from 0 to 1000000 .* or null, got '2'",
        ),
        (
            {"version": 1, "servers": [{"group": "g", "address": A, "weight": 2**64}]},
            rf"^servers\[0\]\.weight: expected an integer from 0 to 1000000 .* got {2**64}",
        ),
        (
            {"version": 1, "servers": [{"group": "g", "address": A, "drain": "no"}]},
            r"^servers\[0\]\.drain: expected true or false",
        ),
        (
            {"version": 1, "servers": [{"group": "g", "address": A, "dwon": True}]},
            r"^servers\[0\]\.dwon: unknown key; expected address, down, drain, group, weight",
        ),
        (
            {
                "version": 1,
                "servers": [
                    {"group": "g", "address": A, "down": True},
                    {"group": "g", "address": A, "drain": True},
                ],
            },
            rf"^servers\[1\]: a second entry for {A} in group g",
        ),
    ],
)
def test_from_json_names_the_field_at_fault(document: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RuntimeState.from_json(document)


def test_from_json_defaults_omitted_fields_and_drops_default_entries() -> None:
    state = RuntimeState.from_json(
        {
            "version": 1,
            "servers": [{"group": "g", "address": A}, {"group": "g", "address": B, "down": True}],
        }
    )
    assert state.servers == {("g", B): ServerOverride(down=True)}


def test_save_then_load_round_trips_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    save_state(path, sample())
    assert load_state(path) == sample()
    save_state(path, RuntimeState.empty().changed("gpus", B, weight=7))
    assert load_state(path) == RuntimeState.empty().changed("gpus", B, weight=7)
    assert sorted(os.listdir(tmp_path)) == ["state.json"]
    assert json.loads(path.read_text())["version"] == 1


def test_save_that_fails_keeps_the_old_file_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    save_state(path, sample())
    target = tmp_path / "taken"
    target.mkdir()
    (target / "inside").write_text("x")  # os.replace cannot replace a non-empty directory
    with pytest.raises(OSError):
        save_state(target, RuntimeState.empty())
    assert sorted(os.listdir(tmp_path)) == ["state.json", "taken"]
    assert load_state(path) == sample()


def test_load_of_a_missing_file_is_the_empty_state(tmp_path: Path) -> None:
    assert load_state(tmp_path / "absent.json") == RuntimeState.empty()


def test_load_of_a_corrupt_file_names_the_file_and_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text('{"version": 1, "servers": [')
    with pytest.raises(ValueError, match=f"^{path}: not a JSON state file"):
        load_state(path)
    path.write_text('{"version": 1, "servers": [{"group": "g", "address": "a", "weight": -2}]}')
    with pytest.raises(ValueError, match=rf"^{path}: servers\[0\]\.weight: expected an integer"):
        load_state(path)


def config_with_secret() -> Config:
    config = quick_config("127.0.0.1:0", [A])
    group = Upstream(
        name="gpus",
        servers=(Server(address=A), Server(address=B)),
        sticky=Sticky(cookie=StickyCookie(secret="s3cret")),
    )
    return attrs.evolve(config, upstreams={"gpus": group})


def test_resolve_server_by_address_and_by_opaque_id() -> None:
    config = config_with_secret()
    assert resolve_server(config, "gpus", A) == A
    ident = server_id("gpus", B, "s3cret").decode("ascii")
    assert ident != server_id("gpus", B).decode("ascii")  # the secret is part of the id
    assert resolve_server(config, "gpus", ident) == B


def test_resolve_server_names_what_is_unknown() -> None:
    config = config_with_secret()
    with pytest.raises(KeyError) as group_error:
        resolve_server(config, "tpus", A)
    assert group_error.value.args[0] == "unknown upstream group 'tpus'; configured groups: gpus"
    with pytest.raises(KeyError) as server_error:
        resolve_server(config, "gpus", "10.0.0.9:8000")
    message = server_error.value.args[0]
    assert message.startswith("upstream group 'gpus' has no server '10.0.0.9:8000'")
    assert f"({A}, {B})" in message


def test_state_is_a_read_only_value_and_its_entries_are_checked() -> None:
    source = {("gpus", A): ServerOverride(down=True)}
    state = RuntimeState(servers=source)
    source.clear()  # the state took a copy
    assert state.get("gpus", A).down
    with pytest.raises(TypeError):
        state.servers[("gpus", B)] = ServerOverride()  # type: ignore[index]
    with pytest.raises(ValueError, match=r"^servers: keys are \(group, address\) pairs"):
        RuntimeState(servers={"gpus": ServerOverride()})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"^servers\[\('gpus', '10.0.0.1:8000'\)\]: expected"):
        RuntimeState(servers={("gpus", A): {"down": True}})  # type: ignore[dict-item]


# -- model alias weights ---------------------------------------------------------------------


def test_alias_weights_are_set_reset_and_kept_through_the_state_file(tmp_path: Path) -> None:
    state = sample().models_changed("chat", {"v1": 0, "v2": 10})
    assert state.model_weight("chat", "v1") == 0 and state.model_weight("chat", "v2") == 10
    assert state.model_weight("chat", "v3") is None and not state.is_empty
    assert state.to_json()["models"] == [
        {"alias": "chat", "model": "v1", "weight": 0},
        {"alias": "chat", "model": "v2", "weight": 10},
    ]
    path = tmp_path / "state.json"
    save_state(path, state)
    assert load_state(path) == state
    # A server change keeps the alias weights; null gives a target its configured one back.
    assert state.changed("gpus", A, weight=3).models == state.models
    assert state.models_changed("chat", {"v1": None}).models == {("chat", "v2"): 10}
    assert "models" not in sample().to_json()  # a state without them is written as before
    assert RuntimeState.empty().models_changed("a", {"m": 1}).is_empty is False
    assert RuntimeState.empty().is_empty


@pytest.mark.parametrize(
    ("entries", "message"),
    [
        ({}, r"^models: expected an array, got dict"),
        ([{"alias": "a", "model": "m"}], r"^models\[0\]\.weight: expected an integer"),
        ([{"alias": "a", "model": "m", "weight": -1}], r"^models\[0\]\.weight: expected"),
        ([{"alias": "a", "model": "", "weight": 1}], r"^models\[0\]\.model: expected a non"),
        ([{"alias": "a", "model": "m", "weight": 1, "x": 1}], r"^models\[0\]\.x: unknown key"),
        (
            [{"alias": "a", "model": "m", "weight": 1}, {"alias": "a", "model": "m", "weight": 2}],
            r"^models\[1\]: a second entry for m of alias a",
        ),
    ],
)
def test_bad_alias_weights_in_a_state_document_name_the_field(
    entries: object, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        RuntimeState.from_json({"version": 1, "servers": [], "models": entries})
    with pytest.raises(ValueError, match=r"^weights\.m: expected an integer"):
        RuntimeState.empty().models_changed("a", {"m": 2**40})
