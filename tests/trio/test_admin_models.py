"""The admin API's change of a model alias's weights, as functions of their input: the body
read (``admin.parse_model_weights``) and the change checked against the configuration
(``control.changed_models``); the whole round trip runs in ``tests/e2e/test_models_e2e.py``."""

from __future__ import annotations

import pytest

from muxproxy.config import parse_config
from muxproxy.config.runtime import RuntimeState
from muxproxy.trio.admin import parse_model_weights
from muxproxy.trio.control import AdminError, changed_models

CONFIG = parse_config(
    {
        "listeners": [{"address": "127.0.0.1:0"}],
        "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
        "models": {
            "chat": {"targets": [{"model": "v1", "weight": 9}, {"model": "v2", "weight": 1}]}
        },
    }
)


def test_weights_are_read_from_the_body() -> None:
    assert parse_model_weights(b'{"weights": {"v1": 0, "v2": null}}') == {"v1": 0, "v2": None}


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"{", "body: not JSON"),
        (b'{"servers": {}}', 'body: expected {"weights"'),
        (b'{"weights": {}}', "weights: expected an object naming at least one target"),
        (b'{"weights": {"v1": true}}', 'weights["v1"]: expected an integer from 0 to 1000000'),
        (b'{"weights": {"v1": 1000001}}', 'weights["v1"]: expected an integer'),
    ],
)
def test_a_bad_body_is_a_400_naming_the_entry(body: bytes, message: str) -> None:
    with pytest.raises(AdminError) as info:
        parse_model_weights(body)
    assert info.value.status == 400 and info.value.message.startswith(message), info.value.message


def test_a_change_is_checked_against_the_aliases_all_or_nothing() -> None:
    state = changed_models(CONFIG, RuntimeState.empty(), "chat", {"v1": 0, "v2": 5})
    assert state.models == {("chat", "v1"): 0, ("chat", "v2"): 5}
    refusals = [
        ("other", {"v1": 1}, 404, "unknown model alias 'other'; configured aliases: chat"),
        ("chat", {"v3": 1}, 404, "weights.v3: the alias 'chat' has no target 'v3'"),
        ("chat", {"v1": 0, "v2": 0}, 400, "every weight of the alias 'chat' would be 0"),
        ("chat", {}, 400, "no weight to change"),
    ]
    for alias, weights, status, message in refusals:
        with pytest.raises(AdminError) as info:
            changed_models(CONFIG, state, alias, weights)
        assert info.value.status == status and info.value.message.startswith(message)
    # v2 at 0 while v1 is 0 in force already: refused too.
    with pytest.raises(AdminError):
        changed_models(CONFIG, state, "chat", {"v2": 0})
