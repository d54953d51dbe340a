"""The optional compiled build's module list (``muxproxy/compiled.py``, read by ``setup.py``)."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import muxproxy.compiled
from muxproxy.compiled import MODULES, build, compiled_modules

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_of_the_compiled_build_has_its_source_in_the_package() -> None:
    for name in MODULES:
        source = ROOT.joinpath(*name.split(".")).with_suffix(".py")
        assert source.is_file(), f"{name}: no {source}"
        module = importlib.import_module(name)
        assert Path(str(module.__file__)).parent == source.parent


def test_the_build_names_what_this_process_runs() -> None:
    done = compiled_modules()
    assert set(done) <= set(MODULES)
    expected = (
        "compiled" if len(done) == len(MODULES) else "partly compiled" if done else "pure Python"
    )
    assert build() == expected
    if os.environ.get("MUXPROXY_EXPECT_COMPILED") == "1":
        assert build() == "compiled"
    else:
        # No extension beside the sources unless scripts/compile put one there.
        so_files = list((ROOT / "muxproxy").rglob("*.so"))
        assert (build() == "pure Python") == (not so_files)
    assert muxproxy.compiled.__file__.endswith(".py"), "the list itself is never compiled"


def test_the_compiled_build_keeps_every_extension_inside_the_package() -> None:
    # A shared library at the checkout's root is found only by a process whose sys.path holds
    # the root: a script in examples/ then failed to import the core.
    assert not list(ROOT.glob("*.so"))
    for name in compiled_modules():
        module = importlib.import_module(name)
        assert Path(str(module.__file__)).parent == ROOT.joinpath(*name.split(".")[:-1])
