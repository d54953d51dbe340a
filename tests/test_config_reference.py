"""The configuration reference (``docs/configuration.md``, ``muxproxy check --explain``), the
pointer for a key in the wrong table, and the warning for a host name that does not resolve.

The reference is built from the loader's own key tables and the records' defaults and
docstrings; these tests hold it to the code: the file is what the code renders, every table
the loader checks is in it, every example loads, and every default it states is the value a
configuration without that key really gets.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import trustme
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_cli import REPO, run_cli

from muxproxy.config import (
    Config,
    ConfigError,
    admin,
    loading,
    logs,
    parse_config,
    sections,
    upstreams,
)
from muxproxy.config.checker import Key
from muxproxy.config.keydocs import entries, iter_examples
from muxproxy.config.layout import tables
from muxproxy.config.reference import explain, render_markdown
from muxproxy.config.resolve import unresolved_servers

REFERENCE = REPO / "docs" / "configuration.md"
MINIMAL = {
    "listeners": [{"address": "127.0.0.1:0"}],
    "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"]}},
}


def test_docs_configuration_md_is_what_the_code_renders() -> None:
    assert REFERENCE.read_text() == render_markdown(), (
        "docs/configuration.md is out of date with the configuration code:"
        " run scripts/config-reference and commit the result"
    )


def test_the_script_finds_the_file_up_to_date() -> None:
    result = subprocess.run(
        [str(REPO / "scripts" / "config-reference"), "--check"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def key_tables() -> list[tuple[str, dict[str, Key]]]:
    """Every module-level table of keys the loader checks a configuration table with."""
    found = []
    for module in (loading, sections, upstreams, admin, logs):
        for name, value in vars(module).items():
            if (
                isinstance(value, dict)
                and value
                and all(isinstance(spec, Key) for spec in value.values())
            ):
                found.append((f"{module.__name__}.{name}", value))
    return found


def test_every_table_the_loader_checks_is_in_the_reference() -> None:
    documented = [table.keys for table in tables()]
    missing = [name for name, keys in key_tables() if not any(keys is d for d in documented)]
    assert key_tables(), "found no key tables: the test looks in the wrong place"
    assert missing == [], f"key tables with no entry in reference._TABLES: {missing}"


def test_every_top_level_section_is_a_table_of_the_reference() -> None:
    roots = {table.path.split(".")[0].removesuffix("[]") for table in tables()}
    assert roots == set(loading._TOP_KEYS)


def test_every_key_is_documented_with_a_type_a_default_and_an_example() -> None:
    everything = entries()
    assert len(everything) == sum(len(table.keys) for table in tables())
    for entry in everything:
        assert entry.doc.strip(), entry.path
        assert entry.kind and entry.default, entry.path
        assert entry.key in entry.example, f"{entry.path}: its example does not set it"
        assert f"### `{entry.path}`" in REFERENCE.read_text()


@pytest.fixture
def tls_files(tmp_path: Path) -> Path:
    """The files the examples name (``cert.pem``, ``key.pem``, ``ca.pem``), real PEM."""
    ca = trustme.CA()
    issued = ca.issue_cert("localhost")
    issued.cert_chain_pems[0].write_to_path(str(tmp_path / "cert.pem"))
    issued.private_key_pem.write_to_path(str(tmp_path / "key.pem"))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))
    return tmp_path


@pytest.mark.parametrize(
    ("path", "document"), [(entry.path, document) for entry, document in iter_examples()]
)
def test_every_example_is_a_valid_configuration(path: str, document: str, tls_files: Path) -> None:
    try:
        parse_config(tomllib.loads(document), base_dir=str(tls_files), environ={})
    except ConfigError as exc:
        pytest.fail(f"the example of {path} does not load:\n{document}\n{exc}")


def parsed_minimal() -> Config:
    return parse_config(MINIMAL, environ={})


def table_values(config: Config) -> dict[str, Any]:
    """The record each reference table becomes, in a configuration that sets none of it."""
    group = config.upstreams["gpus"]
    return {
        "timeouts": config.timeouts,
        "limits": config.limits,
        "upstreams.NAME": group,
        "upstreams.NAME.servers[]": group.servers[0],
        "upstreams.NAME.sticky": group.sticky,
        "upstreams.NAME.next_upstream": group.next_upstream,
        "upstreams.NAME.timeouts": group.timeouts,
        "upstreams.NAME.prefix": group.prefix,
        "upstreams.NAME.queue": group.queue,
        "log": config.log,
    }


def spelled(value: Any) -> str:
    """``value`` as the reference spells a default, without its size note."""
    if value is None:
        return "not set"
    if isinstance(value, bool):
        return str(value).lower()
    if hasattr(value, "value"):
        return f'"{value.value}"'
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, float) and value == int(value):
        return str(int(value))
    if isinstance(value, frozenset):
        items = sorted(value, key=lambda c: (c.startswith("http_"), c))
        return "[" + ", ".join(f'"{item}"' for item in items) + "]"
    if value == ():
        return "none"
    return str(value)


def test_every_stated_default_is_what_a_configuration_without_the_key_gets() -> None:
    values = table_values(parsed_minimal())
    checked = 0
    for entry in entries():
        record = values.get(entry.table.path)
        if record is None or entry.default in ("required", "its own keys"):
            continue
        actual = getattr(record, entry.key)
        if entry.key == "sources":
            assert (actual == () and entry.default == "none") or entry.default == "[]"
            checked += 1
            continue
        assert entry.default.split(" (")[0] == spelled(actual), entry.path
        checked += 1
    assert checked >= 60, f"only {checked} defaults compared"


# -- muxproxy check --explain ---------------------------------------------------------------


def test_explain_prints_a_key_by_its_bare_name(tmp_path: Path) -> None:
    result = run_cli("check", "--explain", "first_token", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("upstreams.NAME.timeouts.first_token  (in [upstreams.NAME.timeouts])")
    assert "seconds (a positive number)" in out
    assert "default:  not set" in out
    assert "first_token = 30" in out


def test_explain_takes_a_concrete_path_and_agrees_with_the_file(tmp_path: Path) -> None:
    result = run_cli("check", "--explain", "upstreams.gpus.servers[2].max_streams", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    (entry,) = [e for e in entries() if e.path == "upstreams.NAME.servers[].max_streams"]
    words = " ".join(entry.doc.replace("`", "").split())
    assert words in " ".join(result.stdout.split())
    assert words in " ".join(REFERENCE.read_text().replace("`", "").split())


def test_explain_of_a_table_lists_its_keys_and_defaults() -> None:
    text = explain("upstreams.prod.sticky")
    assert text is not None
    for key in ("sources", "body_limit", "cookie", "session_idle"):
        assert f"\n  {key} " in text
    assert "600" in text  # session_idle's default


def test_explain_of_a_name_in_several_tables_prints_each() -> None:
    text = explain("timeout")
    assert text is not None
    for path in (
        "upstreams.NAME.health_check.timeout",
        "upstreams.NAME.load_report.timeout",
        "upstreams.NAME.queue.timeout",
    ):
        assert path in text


def test_explain_of_an_unknown_key_fails_with_a_suggestion(tmp_path: Path) -> None:
    result = run_cli("check", "--explain", "first_tokn", cwd=tmp_path)
    assert result.returncode == 2
    assert "no configuration key or table 'first_tokn'" in result.stderr
    assert "did you mean" in result.stderr and "first_token" in result.stderr


def test_check_without_config_or_explain_is_a_usage_error(tmp_path: Path) -> None:
    result = run_cli("check", cwd=tmp_path)
    assert result.returncode == 2
    assert "--config FILE or --explain KEY" in result.stderr


# -- a key in the wrong table ---------------------------------------------------------------


def problems_of(data: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_config(data, environ={})
    return caught.value.problems


def test_first_token_under_the_global_timeouts_points_to_the_group_timeouts() -> None:
    problems = problems_of({**MINIMAL, "timeouts": {"first_token": 30}})
    assert problems == [
        'timeouts.first_token: unknown key; "first_token" belongs in [upstreams.NAME.timeouts]'
    ]


def test_a_group_timeout_in_the_group_table_names_that_group() -> None:
    data = {**MINIMAL, "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"], "idle": 60}}}
    assert problems_of(data) == [
        'upstreams.gpus.idle: unknown key; "idle" belongs in [upstreams.gpus.timeouts]'
    ]


def test_a_server_key_in_the_group_table_shows_where_servers_take_it() -> None:
    data = {**MINIMAL, "upstreams": {"gpus": {"servers": ["127.0.0.1:9001"], "weight": 2}}}
    (problem,) = problems_of(data)
    assert problem.startswith('upstreams.gpus.weight: unknown key; "weight" belongs in a server')
    assert 'upstreams.gpus.servers = [{ address = "...", weight = ... }]' in problem


def test_a_misspelling_still_gets_did_you_mean() -> None:
    assert problems_of({**MINIMAL, "timeouts": {"raed": 3}}) == [
        'timeouts.raed: unknown key; did you mean "read"?'
    ]


def test_a_name_of_many_tables_gets_the_list_of_this_tables_keys() -> None:
    # "timeout" is a key of three tables: a pointer to all of them would not help.
    (problem,) = problems_of({**MINIMAL, "log": {"timeout": 3}})
    assert problem == "log.timeout: unknown key; expected one of: access, format, level"


# -- host names that do not resolve ---------------------------------------------------------

UNRESOLVABLE = "no-such-host.invalid"  # RFC 6761 §6.4: never resolves


def test_check_warns_of_a_server_whose_name_does_not_resolve_and_succeeds(
    tmp_path: Path,
) -> None:
    config = tmp_path / "muxproxy.toml"
    config.write_text(
        '[[listeners]]\naddress = "127.0.0.1:0"\n\n[upstreams.gpus]\n'
        f'servers = ["localhost:9001", "{UNRESOLVABLE}:9001", "127.0.0.1:9001", "[::1]:9001"]\n'
    )
    result = run_cli("check", "--config", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "configuration is valid" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert len(warnings) == 1, result.stderr
    assert warnings[0].startswith(
        f'muxproxy: warning: upstreams.gpus.servers[1]: the host "{UNRESOLVABLE}"'
    )
    assert "resolve" in warnings[0]


def test_resolution_is_bounded_by_its_timeout() -> None:
    config = parse_config(
        {**MINIMAL, "upstreams": {"gpus": {"servers": [f"{UNRESOLVABLE}:1", "127.0.0.1:1"]}}},
        environ={},
    )
    # A zero timeout: the lookup cannot have finished, and is reported as not in time
    # unless it already failed; either way the server is named, and only it.
    (warning,) = unresolved_servers(config, timeout=0)
    assert warning.startswith(f'upstreams.gpus.servers[0]: the host "{UNRESOLVABLE}"')


def test_the_explain_module_runs_as_a_script() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "muxproxy.config.reference"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0
    assert result.stdout == render_markdown()


# -- any document: a Config or a ConfigError, never a crash ---------------------------------

KEY_NAMES = sorted({entry.key for entry in entries()} | set(loading._TOP_KEYS) | {"gpus"})
scalars = st.one_of(
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["127.0.0.1:9001", "gpus", "/v1/", "header:X-Chat-ID", "round_robin"]),
)
keys = st.one_of(st.sampled_from(KEY_NAMES), st.text(max_size=8))
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=3), st.dictionaries(keys, inner, max_size=4)),
    max_leaves=24,
)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    base=st.sampled_from([{}, MINIMAL]),
    extra=st.dictionaries(keys, documents, max_size=4),
)
def test_any_document_gives_a_config_or_problems_named_by_key(
    base: dict[str, Any], extra: dict[str, Any]
) -> None:
    data = {**base, **extra}
    try:
        parse_config(data, environ={})
    except ConfigError as exc:
        assert exc.problems
        for problem in exc.problems:
            path, sep, message = problem.partition(": ")
            assert sep and path and message, problem
