"""``python -m muxproxy.demo``."""

import sys

from . import main

sys.exit(main())
