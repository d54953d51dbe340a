"""The configuration of routing by model: routes' ``models``, ``[models.NAME]`` aliases,
``limits.max_route_body``, the route a path and a model take (``config/routes.py``), and the
examples of ``docs/models.md``."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

from muxproxy.config import Config, ConfigError, Route, parse_config
from muxproxy.config.records import ModelAlias, ModelTarget
from muxproxy.core.exchange.placement import model_aliases

DOCS = Path(__file__).resolve().parent.parent / "docs" / "models.md"


def document(**extra: Any) -> dict[str, Any]:
    return {
        "listeners": [{"address": "127.0.0.1:8080"}],
        "upstreams": {
            "big": {"servers": ["127.0.0.1:9001"]},
            "small": {"servers": ["127.0.0.1:9002"]},
        },
        "routes": [
            {"prefix": "/v1/", "upstream": "big", "models": ["llama-70b", "llama-70b-*"]},
            {"prefix": "/v1/", "upstream": "small", "models": ["llama-8b*"]},
            {"prefix": "/", "upstream": "small"},
        ],
        **extra,
    }


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return info.value.problems


def test_routes_by_model_and_aliases_load() -> None:
    aliases = {"chat": {"targets": [{"model": "llama-70b", "weight": 9}, {"model": "llama-8b"}]}}
    config = parse_config(document(models=aliases, limits={"max_route_body": 4096}))
    assert config.routes[0].models == ("llama-70b", "llama-70b-*")
    assert config.routes[2].models == ()
    assert config.models == {
        "chat": ModelAlias(
            name="chat",
            targets=(ModelTarget(model="llama-70b", weight=9), ModelTarget(model="llama-8b")),
        )
    }
    assert config.limits.max_route_body == 4096
    assert config.by_model
    plain = parse_config(
        {
            "listeners": [{"address": "127.0.0.1:8080"}],
            "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
        }
    )
    assert not plain.by_model and plain.limits.max_route_body == 64 * 1024


def test_the_route_of_a_path_and_a_model() -> None:
    config = parse_config(document())

    def route(path: bytes, model: str | None, config: Config = config) -> Route:
        found = config.route_for(path, model)
        assert found is not None
        return found

    assert route(b"/v1/chat/completions", "llama-70b").upstream == "big"
    assert route(b"/v1/chat/completions", "llama-70b-instruct").upstream == "big"
    assert route(b"/v1/chat/completions", "llama-8b").upstream == "small"
    # Another model, or none: the route without models of the longest prefix.
    assert route(b"/v1/chat/completions", "gpt-4o").prefix == "/"
    assert route(b"/v1/chat/completions", None).prefix == "/"
    # A longer prefix without models wins over a shorter one with them.
    data = document()
    data["routes"].append({"prefix": "/v1/embeddings", "upstream": "big"})
    assert route(b"/v1/embeddings", "llama-8b", parse_config(data)).upstream == "big"
    data = document()
    del data["routes"][2]
    assert parse_config(data).route_for(b"/v1/chat/completions", "gpt-4o") is None


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            {"routes": [{"prefix": "/", "upstream": "big", "models": []}]},
            "routes[0].models: expected an array of model names or globs such as"
            ' ["llama-3.1-70b", "llama-3.1-70b*"], got an empty array',
        ),
        (
            {"routes": [{"prefix": "/", "upstream": "big", "models": ["a", ""]}]},
            'routes[0].models[1]: expected a non-empty model name, got ""',
        ),
        (
            {"routes": [{"prefix": "/", "upstream": "big"}, {"prefix": "/", "upstream": "small"}]},
            'routes[1].prefix: "/" is already routed by routes[0]; give one of them'
            " models = [...] to route the prefix by model",
        ),
        (
            {"models": {"chat": {"targets": []}}},
            "models.chat.targets: expected an array of targets such as"
            ' [{ model = "llama-v1", weight = 9 }, { model = "llama-v2", weight = 1 }],'
            " got an empty array",
        ),
        (
            {"models": {"chat": {}}},
            "models.chat.targets: missing; expected an array of { model, weight } tables",
        ),
        (
            {"models": {"chat": {"targets": [{"weight": 1}]}}},
            "models.chat.targets[0].model: missing; expected the model it sends requests to,"
            ' e.g. "llama-v2"',
        ),
        (
            {"models": {"chat": {"targets": [{"model": "a", "weight": 0}]}}},
            "models.chat.targets: every weight is 0, so the alias serves nothing; give one a"
            " weight above 0",
        ),
        (
            {"models": {"chat": {"targets": [{"model": "a"}, {"model": "a"}]}}},
            'models.chat.targets[1].model: "a" is already a target; list it once',
        ),
        (
            {"models": {"chat": {"targets": [{"model": "a", "weight": 1000001}]}}},
            "models.chat.targets[0].weight: expected 0 to 1000000 (weights are relative"
            " shares), got 1000001; lower it to 1000000 or less",
        ),
        (
            {
                "models": {
                    "chat": {"targets": [{"model": "canary"}]},
                    "canary": {"targets": [{"model": "llama-8b"}]},
                }
            },
            'models.chat.targets[0].model: "canary" is an alias itself; name the model it'
            " stands for (an alias resolves in one step)",
        ),
        (
            {"models": {"chat": {"targets": [{"model": "a", "wieght": 2}]}}},
            'models.chat.targets[0].wieght: unknown key; did you mean "weight"?',
        ),
        (
            {"limits": {"max_route_body": 32 * 1024 * 1024}},
            "limits.max_route_body: expected 1 to 16777216 bytes (16 MiB: held for one"
            " request), got 33554432; lower it to 16777216 or less",
        ),
    ],
)
def test_one_problem(extra: dict[str, Any], message: str) -> None:
    assert problems_of(document(**extra)) == [message]


def _my_sections() -> str:
    """The "Routing by model" and "Aliases and canaries" sections of docs/models.md."""
    text = DOCS.read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)
    mine = [s for s in sections if s.startswith(("Routing by model", "Aliases and canaries"))]
    assert len(mine) == 2
    return "\n".join(mine)


def test_the_examples_of_docs_models_load() -> None:
    blocks = re.findall(r"```toml\n(.*?)```", _my_sections(), flags=re.S)
    assert len(blocks) == 2
    for block in blocks:
        data = tomllib.loads('[[listeners]]\naddress = "127.0.0.1:0"\n' + block)
        config = parse_config(data)
        assert config.by_model


def test_the_model_decides_only_where_a_route_with_models_could_win() -> None:
    table = parse_config(document()).route_table
    assert table.model_decides("/v1/chat/completions")
    assert not table.model_decides("/other")  # only the route without models
    data = document()
    data["routes"].append({"prefix": "/v1/chat/", "upstream": "small"})
    table = parse_config(data).route_table
    assert not table.model_decides("/v1/chat/completions")  # a longer plain prefix wins
    assert table.model_decides("/v1/completions")


def test_the_model_list_names_the_routes_exact_models_and_the_aliases() -> None:
    # GET /v1/models lists what the configuration itself names: a route's exact names (a glob
    # names no one model) and every alias, beside what the groups serve.
    aliases = {"chat": {"targets": [{"model": "llama-70b"}]}}
    assert model_aliases(parse_config(document(models=aliases))) == ("llama-70b", "chat")
    assert model_aliases(parse_config(document())) == ("llama-70b",)
