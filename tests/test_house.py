"""The shape of the package, kept by tests rather than by memory: no import cycle in
``muxproxy/`` and no module over ``MAX_LINES`` lines.

The import graph is read from the source with :mod:`ast`, so it counts every import the
interpreter may run: those at the top, those inside functions (run on first call) and those
under ``if TYPE_CHECKING:`` (a cycle the type checker sees is one a reader must untangle too).
``from package import name`` depends on the package (its ``__init__``) and, when ``name`` is a
submodule, on that submodule as well. Cycles are the strongly connected components of more
than one module (Tarjan).

An allowance names what is known to break a rule today; it may only shrink, and a test fails
when one is no longer needed, so none outlives its reason.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "muxproxy"

MAX_LINES = 600
"""A module's size at most (``docs/architecture.md``: one job per module)."""

CYCLES_ALLOWED: tuple[frozenset[str], ...] = ()
"""Import cycles tolerated: none. (An entry would name a cycle's modules exactly; the test
fails when one is no longer found, so the list can only shrink.)"""

OVERSIZE_ALLOWED: frozenset[str] = frozenset()
"""Modules allowed over ``MAX_LINES`` (paths under ``muxproxy/``): none is. Kept so the rule
reads in one place; an entry added here must still be over, and should not be added."""


def modules(root: Path = PACKAGE) -> dict[str, Path]:
    """Dotted module name -> its file, for every module of the package."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imported(name: str, path: Path, tree: ast.AST) -> Iterator[str]:
    """Every module name an import statement anywhere in ``tree`` may load."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                assert node.module is not None
                target = node.module
            yield target
            yield from (f"{target}.{alias.name}" for alias in node.names)


def import_graph(found: Mapping[str, Path]) -> dict[str, set[str]]:
    """Module -> the package's modules it imports (itself left out)."""
    graph: dict[str, set[str]] = {}
    for name, path in found.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        graph[name] = {m for m in _imported(name, path, tree) if m in found and m != name}
    return graph


def cycles(graph: Mapping[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(sorted(graph[target]))))
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def _show(cycle: frozenset[str]) -> str:
    return f"{len(cycle)} modules: " + ", ".join(sorted(cycle))


def test_the_cycle_finder_finds_a_cycle_through_a_function_local_import(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from .b import thing\n")
    (package / "b.py").write_text("def thing():\n    from . import c\n")
    (package / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import x\n"
    )
    (package / "d.py").write_text("from . import a\n")
    found = cycles(import_graph(modules(package)))
    # d -> pkg (the package) and pkg.a, but nothing leads back to d: no cycle of its own.
    assert found == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]


def test_no_import_cycle_in_the_package() -> None:
    found = cycles(import_graph(modules()))
    unexpected = [cycle for cycle in found if cycle not in CYCLES_ALLOWED]
    assert not unexpected, "import cycles (TYPE_CHECKING and function-local imports count):\n" + (
        "\n".join(_show(cycle) for cycle in unexpected)
    )
    stale = [cycle for cycle in CYCLES_ALLOWED if cycle not in found]
    assert not stale, (
        "CYCLES_ALLOWED lists a cycle that is gone or has changed: shrink it to the cycles"
        " found, or remove it:\n" + "\n".join(_show(cycle) for cycle in stale)
    )


def test_no_module_over_the_size_limit() -> None:
    sizes = {
        path.relative_to(PACKAGE).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in modules().values()
    }
    over = {path: lines for path, lines in sizes.items() if lines > MAX_LINES}
    unexpected = sorted(set(over) - OVERSIZE_ALLOWED)
    assert not unexpected, f"modules over {MAX_LINES} lines:\n" + (
        "\n".join(f"muxproxy/{path}: {over[path]} lines" for path in unexpected)
    )
    stale = sorted(OVERSIZE_ALLOWED - set(over))
    assert not stale, (
        f"OVERSIZE_ALLOWED lists modules no longer over {MAX_LINES} lines (or gone):"
        " remove them:\n" + "\n".join(f"muxproxy/{path}: {sizes.get(path)}" for path in stale)
    )


# -- layers: no arrow runs back up ----------------------------------------------------------

LAYERS: tuple[tuple[str, ...], ...] = (
    ("asgi", "compiled"),
    ("extensions",),
    ("config",),
    ("routing",),
    ("fleet",),
    ("core: vocabulary",),
    ("core/http", "core/apis"),
    ("core/http1", "core/http2", "core/observe"),
    ("core: effects and ports",),
    ("core/streams",),
    ("core/client", "core/upstream"),
    ("core/exchange",),
    ("core/tunnel",),
    ("core: the owner",),
    ("testing", "trio"),
    ("testing/fakellm", "process"),
    ("demo",),
    ("the package's face",),
)
"""The package's parts from the bottom up (``docs/architecture.md``, "The layout"): a part
imports only parts of layers below its own; two parts of one layer import neither the other.
``core/``'s own modules are three parts: the vocabulary every part speaks, the effects and
ports every part holds (they name a few pure rules' types), and the owner that builds them.
``extensions`` (the interface an extension implements) imports nothing of the package: the
configuration loads extensions and the core calls them."""

CORE_OWNER = frozenset({"proxy", "tables", "faults", "shutdown", "statistics"})
CORE_EFFECTS_AND_PORTS = frozenset({"effects", "ports"})


def part_of(module: str) -> str:
    """The part of ``LAYERS`` a module of the package belongs to."""
    parts = module.split(".")[1:]
    if not parts or parts == ["__main__"]:
        return "the package's face"
    if parts[0] == "core" and len(parts) <= 2:
        name = parts[1] if len(parts) == 2 else ""
        if name in CORE_OWNER:
            return "core: the owner"
        if name in CORE_EFFECTS_AND_PORTS:
            return "core: effects and ports"
        if PACKAGE.joinpath("core", name).is_dir() and name:
            return f"core/{name}"
        return "core: vocabulary"
    if parts[0] in ("core", "testing") and len(parts) >= 3:
        return "/".join(parts[:2])
    if parts[0] == "testing" and len(parts) == 2 and PACKAGE.joinpath(*parts).is_dir():
        return "/".join(parts)
    return parts[0]


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    """Each import of a part by a part that is not above it, as ``a -> b (part -> part)``.

    Importing the bare package (``from muxproxy import __version__``) is left out: its
    ``__init__`` runs before any of its modules anyway."""
    rank = {part: level for level, parts in enumerate(LAYERS) for part in parts}
    found = []
    for module, imported in sorted(graph.items()):
        for target in sorted(imported):
            here, there = part_of(module), part_of(target)
            if target == PACKAGE.name or here == there:
                continue
            assert here in rank and there in rank, f"{module} or {target}: a part not in LAYERS"
            if rank[there] >= rank[here]:
                found.append(f"{module} -> {target} ({here} -> {there})")
    return found


def test_every_part_of_the_package_has_its_layer() -> None:
    parts = {part_of(module) for module in modules()}
    listed = {part for layer in LAYERS for part in layer}
    assert parts == listed, (
        f"not in LAYERS: {sorted(parts - listed)}; gone: {sorted(listed - parts)}"
    )


def test_no_import_runs_back_up_the_layers() -> None:
    found = upward_imports(import_graph(modules()))
    assert not found, "imports that run back up (or across one layer):\n" + "\n".join(found)


def test_the_layer_check_finds_an_import_up_the_layers() -> None:
    graph = {"muxproxy.routing.router": {"muxproxy.core.exchange.exchange"}}
    assert upward_imports(graph) == [
        "muxproxy.routing.router -> muxproxy.core.exchange.exchange (routing -> core/exchange)"
    ]
