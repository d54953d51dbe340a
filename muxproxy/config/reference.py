"""The configuration reference: every key ``muxproxy check`` accepts, with its type, default,
meaning and an example, as Markdown and in a terminal.

``docs/configuration.md`` is :func:`render_markdown` (``scripts/config-reference`` writes it;
a test fails when it is out of date) and ``muxproxy check --explain KEY`` prints
:func:`explain`. What each entry says is :mod:`.keydocs`, built from the code that checks a
configuration; the tables and the hint for a key in the wrong table are :mod:`.layout`. This
module only renders them.
"""

from __future__ import annotations

import difflib
import textwrap

from muxproxy.config.keydocs import OWN_KEYS, PHRASES, Entry, entries
from muxproxy.config.layout import TABLES, Table, table_pattern

__all__ = ["explain", "lookup", "render_markdown", "suggestions"]


def lookup(query: str) -> list[Entry] | list[Table]:
    """The entries (or the table) that ``query`` names: a key path, concrete
    (``upstreams.gpus.servers[0].weight``) or as the reference writes it, a table's path, or
    a bare key name (every table's key of that name)."""
    pattern, _ = table_pattern(query.strip().strip("[]"))
    everything = entries()
    exact = [entry for entry in everything if entry.path == pattern]
    if exact:
        return exact
    table = [table for table in TABLES if table.path.replace("[]", "") == pattern.replace("[]", "")]
    if table:
        return table
    return [entry for entry in everything if entry.key == pattern]


def explain(query: str) -> str | None:
    """The reference's text for ``query`` (see :func:`lookup`), or None when it names
    nothing."""
    found = lookup(query)
    if not found:
        return None
    parts = []
    for item in found:
        if isinstance(item, Table):
            parts.append(_explain_table(item))
        else:
            parts.append(_explain_entry(item))
    return "\n\n".join(parts)


def suggestions(query: str) -> list[str]:
    """Key paths close to ``query``, for a query that names nothing."""
    pattern, _ = table_pattern(query.strip())
    paths = [entry.path for entry in entries()]
    keys = sorted({entry.key for entry in entries()})
    close = difflib.get_close_matches(pattern, paths, n=3, cutoff=0.6)
    close += difflib.get_close_matches(pattern.rpartition(".")[2], keys, n=3, cutoff=0.7)
    return list(dict.fromkeys(close))


def _plain(text: str) -> str:
    return text.replace("`", "")


def _wrap(text: str, indent: str) -> list[str]:
    lines = []
    for paragraph in text.split("\n\n"):
        lines.extend(
            textwrap.wrap(_plain(paragraph), 92, initial_indent=indent, subsequent_indent=indent)
            or [indent]
        )
        lines.append("")
    return lines[:-1]


def _explain_entry(entry: Entry) -> str:
    lines = [
        f"{entry.path}  (in {entry.table.heading})",
        f"  type:     {entry.kind}",
        f"  default:  {entry.default}",
        "",
        *_wrap(entry.doc, "  "),
        "",
        "  example:",
        *(f"    {line}" for line in entry.example.splitlines()),
    ]
    if entry.section is not None:
        lines += ["", _explain_table(entry.section)]
    return "\n".join(lines)


def _explain_table(table: Table) -> str:
    lines = [table.heading, *_wrap(table.summary, "  "), ""]
    for entry in entries():
        if entry.table is table:
            lines.append(f"  {entry.key:<24} {entry.default:<20} {entry.kind}")
    return "\n".join(lines)


# -- docs/configuration.md --

_INTRO = """\
# Configuration reference

Every key `muxproxy check` accepts, with its type, its default and what it does. This file is
generated from the code that checks a configuration (`muxproxy/config/reference.py`) by
`scripts/config-reference`; a test fails when it is out of date, so it is always the truth
of the code. `muxproxy check --explain KEY` prints one entry in a terminal
(`muxproxy check --explain first_token`, `--explain upstreams.gpus.sticky`).

A configuration is one TOML file, checked whole before it is used: `muxproxy check --config
FILE` names every problem with its key and the fix, and a reload with a bad file keeps the
running configuration. Durations are seconds (a number, `0.5` is half a second); sizes are
bytes (an integer). A key left out takes its default. A key in the wrong table gets a
pointer to the right one (`timeouts.first_token: unknown key; "first_token" belongs in
[upstreams.NAME.timeouts]`).

The smallest configuration:

```toml
[[listeners]]
address = "0.0.0.0:8080"

[upstreams.gpus]
servers = ["10.0.0.1:8000", "10.0.0.2:8000"]
```

`muxproxy serve --listen HOST:PORT --upstream HOST:PORT ...` runs the same thing without a
file. The environment variable `MUXPROXY_ADMIN_TOKEN`, when set, is the admin token and wins
over `[admin] token`; `MUXPROXY_FLEET_STORE`, when set, is the fleet's store and wins over
`[fleet] store` (a URL with a password then comes from a Secret, not the file).
"""


def render_markdown() -> str:
    """``docs/configuration.md``."""
    out = [_INTRO, "## Tables\n"]
    for table in TABLES:
        out.append(f"- [`{table.heading}`](#{table.anchor}): {table.summary.split('. ')[0]}")
    out.append("")
    everything = entries()
    for table in TABLES:
        out += [f'<a id="{table.anchor}"></a>', "", f"## `{table.heading}`", "", table.summary]
        out += ["", "| key | type | default |", "|---|---|---|"]
        mine = [entry for entry in everything if entry.table is table]
        for entry in mine:
            out.append(
                f"| [`{entry.key}`](#{entry.anchor}) | {entry.kind} | {_md_default(entry)} |"
            )
        out.append("")
        for entry in mine:
            out += [f'<a id="{entry.anchor}"></a>', "", f"### `{entry.path}`", ""]
            out += [f"**Type:** {entry.kind}. **Default:** {_md_default(entry)}.", "", entry.doc]
            out += ["", "```toml", entry.example, "```", ""]
    return "\n".join(out).rstrip("\n") + "\n"


def _md_default(entry: Entry) -> str:
    if entry.section is not None and entry.default == OWN_KEYS:
        return f"[its own keys](#{entry.section.anchor})"
    return entry.default if entry.default in PHRASES else f"`{entry.default}`"


if __name__ == "__main__":
    print(render_markdown(), end="")
