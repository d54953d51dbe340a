"""``python -m muxproxy``: the :mod:`muxproxy.cli` command line."""

from muxproxy.cli import main

raise SystemExit(main())
