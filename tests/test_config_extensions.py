"""``[[extensions]]`` (``muxproxy/config/extensionkeys.py``): each way an entry can be wrong is
one problem naming ``extensions[N].<key>`` and the fix; a good entry's extension is made."""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest

from muxproxy.config import ConfigError, load_config, parse_config
from muxproxy.config.extensions import HookErrorPolicy
from muxproxy.extensions import Extension, Settings

BASE: dict[str, Any] = {
    "listeners": [{"address": "127.0.0.1:0"}],
    "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
}

MODULE = """
from muxproxy.extensions import Extension, Settings

class Needs(Extension):
    def __init__(self, settings):
        super().__init__(settings)
        self.keys = settings["keys"]

class Plain:
    pass
"""


@pytest.fixture(autouse=True)
def module_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "hookmod_for_tests.py").write_text(MODULE)
    (tmp_path / "hookmod_raises.py").write_text("raise ValueError('broken module')\n")
    monkeypatch.syspath_prepend(str(tmp_path))


def problems(*entries: Any) -> list[str]:
    try:
        parse_config({**BASE, "extensions": list(entries)}, environ={})
    except ConfigError as exc:
        return exc.problems
    return []


def test_a_good_entry_is_made_with_its_settings_and_survives_a_pickle() -> None:
    entry = {"module": "hookmod_for_tests:Needs", "settings": {"keys": "k.txt"}, "timeout": 2}
    config = parse_config({**BASE, "extensions": [entry]}, environ={})
    (loaded,) = config.extensions
    assert isinstance(loaded.instance, Extension) and loaded.instance.keys == "k.txt"
    assert loaded.timeout == 2.0 and loaded.on_error is HookErrorPolicy.REJECT
    again = pickle.loads(pickle.dumps(config))
    assert again.extensions[0].instance is not loaded.instance  # made afresh where unpickled
    assert again.extensions[0].instance.keys == "k.txt"


@pytest.mark.parametrize(
    ("entry", "expected"),
    [
        ({"module": "no_such_module_here:X"}, "extensions[0].module: cannot import"),
        ({"module": "hookmod_raises:X"}, "extensions[0].module: importing 'hookmod_raises' raised"),
        ({"module": "hookmod_for_tests:Missing"}, "has no 'Missing'; check the class name"),
        ({"module": "hookmod_for_tests:Plain"}, "is not a class derived from"),
        ({"module": "hookmod_for_tests:Needs"}, "refused its settings: KeyError: 'keys'"),
        ({"module": "not a name"}, 'extensions[0].module: expected "package.module:Class"'),
        ({}, "extensions[0].module: missing; expected the extension class"),
        ({"module": "hookmod_for_tests:Needs", "on_error": "x"}, "extensions[0].on_error"),
        ({"module": "hookmod_for_tests:Needs", "timeout": 600}, "extensions[0].timeout"),
        ({"module": "hookmod_for_tests:Needs", "settings": 3}, "extensions[0].settings"),
        (
            {"module": "hookmod_for_tests:Needs", "settings": {"keys": "k"}, "colour": 1},
            "colour: unknown",
        ),
    ],
)
def test_each_bad_entry_is_named_with_its_fix(entry: dict[str, Any], expected: str) -> None:
    found = problems(entry)
    assert len(found) == 1 and expected in found[0], found


def test_extensions_must_be_an_array_of_tables() -> None:
    try:
        parse_config({**BASE, "extensions": {"module": "x:Y"}}, environ={})
    except ConfigError as exc:
        assert exc.problems == [
            "extensions: expected an array of tables ([[extensions]]), got a table"
        ]
    else:
        raise AssertionError("accepted")


PATHS_MODULE = """
from muxproxy.extensions import Extension, Settings

class ReadsFile(Extension):
    def __init__(self, settings):
        super().__init__(settings)
        self.text = self.settings.path("file").read_text()
"""


def test_a_relative_path_in_settings_starts_at_the_configuration_files_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "hookmod_paths.py").write_text(PATHS_MODULE)
    conf = tmp_path / "conf"
    (conf / "keys").mkdir(parents=True)
    (conf / "keys" / "list.txt").write_text("from beside the configuration\n")
    (conf / "muxproxy.toml").write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\n'
        '[upstreams.gpus]\nservers = ["127.0.0.1:9001"]\n'
        '[[extensions]]\nmodule = "hookmod_paths:ReadsFile"\n'
        'settings = { file = "keys/list.txt" }\n'
    )
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)  # not where the configuration is
    config = load_config(Path("..") / "conf" / "muxproxy.toml")
    (loaded,) = config.extensions
    assert loaded.instance.text == "from beside the configuration\n"
    assert loaded.instance.settings.config_dir == conf.resolve()
    monkeypatch.chdir(tmp_path)  # a worker elsewhere makes it again from the same file
    again = pickle.loads(pickle.dumps(config))
    assert again.extensions[0].instance.text == "from beside the configuration\n"


def test_settings_path_keeps_an_absolute_path_and_refuses_a_non_string(tmp_path: Path) -> None:
    settings = Settings({"a": str(tmp_path / "k.txt"), "n": 3}, config_dir="/etc/muxproxy")
    assert settings.path("a") == tmp_path / "k.txt"
    assert dict(settings) == {"a": str(tmp_path / "k.txt"), "n": 3}
    with pytest.raises(TypeError, match=r"settings\.n: expected a path"):
        settings.path("n")
