"""The configuration of a group's models: listed (``models``) or learnt from its servers
(``learn_models``, ``models_refresh``), each mistake named by its key."""

from __future__ import annotations

import tomllib

import pytest

from muxproxy.config import Config, ConfigError, parse_config

HEAD = """\
[[listeners]]
address = "127.0.0.1:8080"

[[routes]]
prefix = "/"
upstream = "gpus"

[upstreams.gpus]
servers = ["127.0.0.1:9001"]
"""


def parse(group: str) -> Config:
    return parse_config(tomllib.loads(HEAD + group))


def test_listed_and_learnt_models_are_read() -> None:
    listed = parse('models = ["llama-3.1-70b", "meta-llama/Llama-3.1-8B"]\n')
    group = listed.upstreams["gpus"]
    assert group.models == ("llama-3.1-70b", "meta-llama/Llama-3.1-8B")
    assert not group.learn_models
    learnt = parse("learn_models = true\nmodels_refresh = 300\n")
    group = learnt.upstreams["gpus"]
    assert (group.models, group.learn_models, group.models_refresh) == ((), True, 300.0)


@pytest.mark.parametrize(
    ("group", "problem"),
    [
        ('models = "llama"\n', "upstreams.gpus.models: expected an array of model names"),
        ('models = ["a", ""]\n', "upstreams.gpus.models[1]: expected a model name of 1 to 256"),
        ('models = ["a", 3]\n', "upstreams.gpus.models[1]: expected a model name"),
        ('models = ["a", "a"]\n', "upstreams.gpus.models[1]: 'a' is listed twice"),
        (
            'models = ["a"]\nlearn_models = true\n',
            "upstreams.gpus.learn_models: and models are both set",
        ),
        ("models_refresh = 30\n", "upstreams.gpus.models_refresh: is how often learnt models"),
        ("learn_models = true\nmodels_refresh = 0.5\n", "upstreams.gpus.models_refresh: expected"),
        ("learn_models = true\nmodels_refresh = 7200\n", "upstreams.gpus.models_refresh: expected"),
    ],
)
def test_a_mistake_is_named_by_its_key(group: str, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse(group)
    assert any(p.startswith(problem) for p in caught.value.problems), caught.value.problems


def test_more_than_1024_models_are_refused() -> None:
    names = ", ".join(f'"m{i}"' for i in range(1025))
    with pytest.raises(ConfigError) as caught:
        parse(f"models = [{names}]\n")
    assert caught.value.problems == [
        "upstreams.gpus.models: expected at most 1024 model names, got 1025"
    ]
