"""``examples/fleet.py``, run as a user runs it: three replicas, Redis, DNS, a gray release.

The example exits 0 only when no turn failed, every turn ran, and no conversation changed
server while it was up; its report must also show every replica on the last version of the
runtime state and with the engine that joined the DNS answer half way.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "fleet.py"


def test_the_fleet_example_runs_a_gray_release_across_three_replicas() -> None:
    result = subprocess.run(
        [sys.executable, str(EXAMPLE), "--conversations", "6"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
    assert "every replica discovered the 4 engines" in out
    assert re.search(r"turns: 72, failed: 0\n", out), out
    assert "conversations: 24, that changed server while it was up: 0" in out
    # One weights call per step, each applied by the two other replicas.
    assert len(re.findall(r"replica \d applied it \d+ ms after the answer", out)) == 8
    rows = re.findall(r"^\s+(\d)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)  ", out, re.MULTILINE)
    assert [(r[0], r[2], r[3], r[4]) for r in rows] == [
        ("1", "0", "4", "5"),
        ("2", "0", "4", "5"),
        ("3", "0", "4", "5"),
    ], out
    # Every replica found the engine added to the DNS answer.
    assert len(re.findall(r"replica \d found it \d+ ms later", out)) == 3
    # v2's share of new conversations: none at 0 %, all at 100 %.
    steps = dict(re.findall(r"^\s+(\d)\s+6\s+(\d+)  \(\d+ %\)$", out, re.MULTILINE))
    assert steps["0"] == "0" and steps["3"] == "6", out
