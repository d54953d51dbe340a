"""The ``[admin]`` section and ``serve --admin`` (:mod:`muxproxy.config.admin`), and what
``muxproxy check`` says about them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from muxproxy.config import (
    ADMIN_TOKEN_ENV,
    AdminSettings,
    ConfigError,
    load_config,
    parse_config,
    parse_quick_config,
)
from muxproxy.process.cli import main

BASE = {
    "listeners": [{"address": "127.0.0.1:8080"}],
    "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
}


def parsed(admin: Any, environ: dict[str, str] | None = None, base_dir: str | None = None) -> Any:
    return parse_config({**BASE, "admin": admin}, environ=environ or {}, base_dir=base_dir)


def problems(admin: Any, environ: dict[str, str] | None = None) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parsed(admin, environ)
    return caught.value.problems


def test_no_admin_section_means_no_admin_listener() -> None:
    assert parse_config(BASE, environ={ADMIN_TOKEN_ENV: "t"}).admin is None


def test_an_empty_admin_section_listens_on_loopback() -> None:
    assert parsed({}).admin == AdminSettings(address="127.0.0.1:9901")


def test_every_key(tmp_path: Path) -> None:
    admin = {"address": "[::1]:0", "token": "abc-DEF_123.~+/==", "state_file": "state.json"}
    settings = parsed(admin, base_dir=str(tmp_path)).admin
    assert settings == AdminSettings(
        address="[::1]:0", token="abc-DEF_123.~+/==", state_file=str(tmp_path / "state.json")
    )
    assert (settings.host, settings.port) == ("::1", 0)


def test_the_environment_token_wins_over_the_file() -> None:
    settings = parsed({"token": "from-file"}, {ADMIN_TOKEN_ENV: "from-env"}).admin
    assert settings.token == "from-env"
    assert parsed({"token": "from-file"}, {ADMIN_TOKEN_ENV: ""}).admin.token == "from-file"


@pytest.mark.parametrize(
    ("admin", "message"),
    [
        ({"address": "localhost"}, 'admin.address: expected "host:port", got "localhost"'),
        ({"adress": "127.0.0.1:1"}, 'admin.adress: unknown key; did you mean "address"?'),
        ({"token": "two words"}, "admin.token: expected a bearer token"),
        ({"token": 12}, "admin.token: expected a bearer token: letters, digits and -._~+/"),
        ({"token": ""}, "admin.token: expected a bearer token"),
        ({"state_file": ""}, 'admin.state_file: expected a file path, got ""'),
        ({"state_file": "/no/such/dir/state.json"}, 'the directory "/no/such/dir" does not'),
        ("on", "admin: expected a table, got"),
    ],
)
def test_one_problem_names_its_key(admin: Any, message: str) -> None:
    found = problems(admin)
    assert len(found) == 1
    assert message in found[0]


def test_an_invalid_environment_token_is_named() -> None:
    assert problems({}, {ADMIN_TOKEN_ENV: "a b"}) == [
        f"{ADMIN_TOKEN_ENV}: expected a bearer token: letters, digits and -._~+/ (RFC 6750"
        " §2.1), got a string of other characters"
    ]


@pytest.mark.parametrize("address", ["0.0.0.0:9901", "10.1.2.3:9901", "[::]:9901", "admin:9901"])
def test_a_non_loopback_address_needs_a_token(address: str) -> None:
    found = problems({"address": address})
    assert len(found) == 1
    assert found[0].startswith(f'admin.token: missing; the admin address "{address}" is not')
    assert ADMIN_TOKEN_ENV in found[0]
    assert parsed({"address": address, "token": "t"}).admin.token == "t"
    assert parsed({"address": address}, {ADMIN_TOKEN_ENV: "t"}).admin.token == "t"


@pytest.mark.parametrize("address", ["127.0.0.1:9901", "127.8.9.1:1", "[::1]:9901", "localhost:1"])
def test_a_loopback_address_needs_no_token(address: str) -> None:
    assert parsed({"address": address}).admin.token is None


def test_a_state_file_that_is_not_valid_is_named(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"version": 1, "servers": [{"group": "gpus", "weight": 1}]}))
    found = problems({"state_file": str(state)})
    assert len(found) == 1
    assert found[0].startswith(f"admin.state_file: {state}: servers[0].address: expected")
    assert "fix or remove the file" in found[0]


def test_a_directory_as_the_state_file_is_refused(tmp_path: Path) -> None:
    assert problems({"state_file": str(tmp_path)}) == [
        f'admin.state_file: expected a file, got the directory "{tmp_path}"'
    ]


def test_a_valid_state_file_or_none_yet_is_accepted(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    assert parsed({"state_file": str(state)}).admin.state_file == str(state)
    state.write_text('{"version": 1, "servers": []}')
    assert parsed({"state_file": str(state)}).admin.state_file == str(state)


def test_serve_admin_flag() -> None:
    config = parse_quick_config("127.0.0.1:0", ["127.0.0.1:9001"], admin="127.0.0.1:0", environ={})
    assert config.admin == AdminSettings(address="127.0.0.1:0")
    config = parse_quick_config(
        "127.0.0.1:0", ["127.0.0.1:9001"], admin="0.0.0.0:9901", environ={ADMIN_TOKEN_ENV: "t"}
    )
    assert config.admin == AdminSettings(address="0.0.0.0:9901", token="t")
    with pytest.raises(ConfigError) as caught:
        parse_quick_config("127.0.0.1:0", ["127.0.0.1:9001"], admin="0.0.0.0:9901", environ={})
    assert caught.value.problems[0].startswith('--admin: the admin address "0.0.0.0:9901" is not')
    assert f"set {ADMIN_TOKEN_ENV}, or" in caught.value.problems[0]
    with pytest.raises(ConfigError) as caught:
        parse_quick_config("127.0.0.1:0", ["127.0.0.1:9001"], admin="9901", environ={})
    assert caught.value.problems == ['--admin: expected "host:port", got "9901"']


def test_check_refuses_an_unguarded_admin_address_and_says_how_to_fix_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(ADMIN_TOKEN_ENV, raising=False)
    config = tmp_path / "muxproxy.toml"
    config.write_text(
        '[[listeners]]\naddress = "127.0.0.1:8080"\n'
        '[upstreams.gpus]\nservers = ["127.0.0.1:9001"]\n'
        '[admin]\naddress = "0.0.0.0:9901"\n'
    )
    assert main(["check", "--config", str(config)]) == 2
    err = capsys.readouterr().err
    assert "admin.token: missing" in err
    assert "set [admin] token (or the environment variable MUXPROXY_ADMIN_TOKEN)" in err
    monkeypatch.setenv(ADMIN_TOKEN_ENV, "secret-value")
    assert main(["check", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "admin http://0.0.0.0:9901 (token set)" in out
    assert "secret-value" not in out
    assert load_config(config).admin == AdminSettings(address="0.0.0.0:9901", token="secret-value")


def test_serve_admin_is_refused_with_a_configuration_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "muxproxy.toml"
    config.write_text('[[listeners]]\naddress = "127.0.0.1:0"\n[upstreams.g]\nservers = ["a:1"]\n')
    assert main(["serve", "--config", str(config), "--admin", "127.0.0.1:0"]) == 2
    assert "--admin cannot be used with --config" in capsys.readouterr().err
