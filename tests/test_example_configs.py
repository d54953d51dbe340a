"""The configurations we show as the ones to run (README.md's main example and
``deploy/muxproxy.toml``) run what saves streams, and pass ``muxproxy check``.

A backend that dies mid-answer cut every stream it carried while the feature that finishes
them (``continue_on_failure``) was left out of both; these tests keep it, and what goes with
it, in.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from muxproxy.config import ADMIN_TOKEN_ENV, Config, parse_config
from muxproxy.process.cli import main

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DEPLOY = ROOT / "deploy" / "muxproxy.toml"


def readme_example() -> str:
    """The README's first TOML block: its main configuration example."""
    blocks = re.findall(r"^```toml\n(.*?)^```", README.read_text(encoding="utf-8"), re.M | re.S)
    assert blocks, "README.md: no toml block"
    return str(blocks[0])


def parsed(text: str, base_dir: Path) -> Config:
    return parse_config(tomllib.loads(text), base_dir=str(base_dir), environ={ADMIN_TOKEN_ENV: "t"})


def test_the_readme_example_passes_muxproxy_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "muxproxy.toml"
    path.write_text(readme_example(), encoding="utf-8")
    assert main(["check", "--config", str(path)]) == 0, capsys.readouterr().err
    assert "continue on failure" in capsys.readouterr().out


@pytest.mark.parametrize("source", ["README.md", "deploy/muxproxy.toml"])
def test_the_example_configuration_retries_continues_and_checks_health(
    source: str, tmp_path: Path
) -> None:
    text = readme_example() if source == "README.md" else DEPLOY.read_text(encoding="utf-8")
    config = parsed(text, tmp_path if source == "README.md" else DEPLOY.parent)
    assert config.routes
    for route in config.routes:
        # Before the first token: retried unseen; after it: finished by the next server.
        assert route.retry_until_first_event, route.prefix
        assert route.continue_on_failure, route.prefix
        group = config.upstreams[route.upstream]
        assert group.health_check is not None, group.name
        retry = group.next_upstream
        assert retry.tries >= 2, group.name
        # A continuation is a try, and none starts past tries_timeout: it must cover the
        # answers a stop lets finish, or a long answer that breaks is cut all the same.
        assert retry.tries_timeout >= config.timeouts.shutdown_grace, group.name
        assert group.timeouts.connect is not None and group.timeouts.first_token is not None
