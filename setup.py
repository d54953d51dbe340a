"""The optional compiled build: the per-token modules compiled with mypyc.

Everything else about the package is in ``pyproject.toml``. A plain ``pip install .`` (or
``-e .``) builds pure Python and needs no compiler. With ``MUXPROXY_COMPILE=1`` the modules of
``muxproxy/compiled.py``'s ``MODULES`` are compiled to C extensions by mypyc (the core is
``mypy --strict`` clean, which is what mypyc needs); the rest stays Python, and Python imports
an extension module before the ``.py`` beside it. A failed compile (no C compiler, no mypy)
falls back to pure Python with a warning, unless ``MUXPROXY_COMPILE=require``.

    scripts/compile                                  # in place, in a checkout (.venv's mypy)
    MUXPROXY_COMPILE=1 pip install --no-build-isolation .   # an install; needs mypy beside
"""

from __future__ import annotations

import os
import runpy
import sys
from pathlib import Path
from typing import Any

from setuptools import setup
from setuptools.command.build_ext import build_ext

WANTED = os.environ.get("MUXPROXY_COMPILE", "")


def modules() -> list[str]:
    """The source files to compile, read from ``muxproxy/compiled.py`` without importing the
    package (its dependencies need not be installed while it builds)."""
    here = Path(__file__).resolve().parent
    names: list[str] = runpy.run_path(str(here / "muxproxy" / "compiled.py"))["MODULES"]
    return [str(Path(*name.split(".")).with_suffix(".py")) for name in names]


class OptionalBuildExt(build_ext):
    """Compile the extensions, or (``MUXPROXY_COMPILE=1``) leave pure Python when that fails."""

    def run(self) -> None:
        try:
            super().run()
        except Exception as exc:
            self._fall_back(exc)

    def build_extension(self, ext: Any) -> None:
        try:
            super().build_extension(ext)
        except Exception as exc:
            self._fall_back(exc)

    def _fall_back(self, exc: Exception) -> None:
        if WANTED == "require":
            raise
        print(f"muxproxy: compiled build failed ({exc}); pure Python instead", file=sys.stderr)


def ext_modules() -> list[Any]:
    if WANTED not in ("1", "require"):
        return []
    try:
        from mypyc.build import mypycify
    except ImportError as exc:
        if WANTED == "require":
            raise
        print(f"muxproxy: no mypyc ({exc}); pure Python", file=sys.stderr)
        return []
    level = os.environ.get("MYPYC_OPT_LEVEL", "3")  # 0 builds faster, for trying things out
    # One group per module (separate=True): each shared library is named after its module and
    # sits beside it in the package, so a script whose sys.path does not hold the checkout's
    # root (examples/, an installed copy) finds them all; the extensions build in parallel.
    return list(mypycify(modules(), opt_level=level, separate=True))


setup(ext_modules=ext_modules(), cmdclass={"build_ext": OptionalBuildExt})
