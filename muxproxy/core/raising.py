"""When an internal error re-raises, and whether it came out of the core.

A bug in muxproxy ends the one connection it concerns (``faults.py``), unless
``MUXPROXY_RAISE_ERRORS`` asks for it to re-raise (tests, debugging). A driver that catches an
exception must tell a broken invariant of the core (``ProxyCore.handle`` raised: stop) from a
failure of its own code for one connection (abandon that one): :func:`raised_by_handle`.
A leaf module: the drivers ask it without importing the core's owner for it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

__all__ = ["RAISE_ERRORS_ENV", "raise_errors_from_environment", "raised_by_handle"]

RAISE_ERRORS_ENV = "MUXPROXY_RAISE_ERRORS"
"""Set to anything but "" or "0": internal errors re-raise instead of ending one connection."""


def raise_errors_from_environment(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``MUXPROXY_RAISE_ERRORS`` asks for internal errors to re-raise."""
    return environ.get(RAISE_ERRORS_ENV, "") not in ("", "0")


_HANDLE_FILE = "muxproxy/core/proxy.py"
"""``ProxyCore.handle``'s source as its frames name it: the absolute path in pure Python, the
path relative to the package's parent in the compiled build (whose frames mypyc makes for
tracebacks only, with no code object of the method to compare against)."""


def raised_by_handle(exc: BaseException) -> bool:
    """Whether ``exc`` (or one in its group) came out of ``ProxyCore.handle``: for a driver,
    a broken invariant of the core (stop), not a failure of the driver's own code for one
    connection (abandon that one)."""
    if isinstance(exc, BaseExceptionGroup):
        return any(raised_by_handle(inner) for inner in exc.exceptions)
    tb = exc.__traceback__
    while tb is not None:
        code = tb.tb_frame.f_code
        if code.co_name == "handle" and code.co_filename.replace("\\", "/").endswith(_HANDLE_FILE):
            return True
        tb = tb.tb_next
    return False
