"""``python -m muxproxy.demo``."""

import sys

from muxproxy.demo import main

sys.exit(main())
