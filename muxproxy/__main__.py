"""``python -m muxproxy``: the :mod:`muxproxy.process.cli` command line."""

from muxproxy.process.cli import main

raise SystemExit(main())
