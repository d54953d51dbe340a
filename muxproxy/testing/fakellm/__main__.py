"""``python -m muxproxy.testing.fakellm``: the same options as ``muxproxy fakellm``."""

import sys

from muxproxy.testing.fakellm.server import main

sys.exit(main())
