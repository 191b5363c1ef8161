"""The house as built: the import graph of ``kvtier/`` has no cycle and only the shared
vocabulary sits loose at the top. The graph is read from every ``import``/``from`` statement
with ``ast`` (type-checking imports and imports inside functions included), so a cycle that
Python tolerates at run time still fails here."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "kvtier"

TOP_LEVEL_MODULES = 8
"""Loose modules allowed directly under ``kvtier/`` besides ``__init__.py`` and ``cli.py``."""


def _modules(root: Path = ROOT) -> dict[str, Path]:
    mods = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def _resolve(name: str, mods: dict[str, Path]) -> str | None:
    """The module of ours that importing ``name`` runs (``a.b.C`` -> ``a.b``)."""
    while name and name not in mods:
        name = name.rpartition(".")[0]
    return name or None


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """``module -> modules of the package at root it imports``, from every import statement
    in its file."""
    mods = _modules(root)
    graph: dict[str, set[str]] = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                deps.update(filter(None, (_resolve(a.name, mods) for a in node.names)))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for alias in node.names:
                    # ``from pkg import sub`` imports the submodule; ``from mod import name``
                    # the module.
                    sub = f"{source}.{alias.name}"
                    target = sub if sub in mods else _resolve(source, mods)
                    if target:
                        deps.add(target)
        deps.discard(mod)
        graph[mod] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        found.append(sorted(comp))
    return found


def test_the_cycle_finder_finds_a_loop() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_reads_every_kind_of_import(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n")
    (pkg / "a.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.b import B\n"
    )
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import g\n    from . import c\n")
    (pkg / "sub" / "c.py").write_text("import pkg.a\n")
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.sub.b"}
    assert graph["pkg.sub.b"] == {"pkg.a", "pkg.sub.c"}
    assert graph["pkg.sub.c"] == {"pkg.a"}
    assert graph["pkg.sub"] == {"pkg.sub.b"}
    assert cycles(graph) == [["pkg.a", "pkg.sub.b", "pkg.sub.c"]]


def test_no_import_cycle_in_kvtier() -> None:
    graph = import_graph()
    found = cycles(graph)
    lines = []
    for comp in found:
        lines.append(" <-> ".join(str(_modules()[m].relative_to(ROOT.parent)) for m in comp))
        for m in comp:
            lines.append(f"    {m} imports {sorted(graph[m] & set(comp))}")
    assert not found, "import cycles:\n" + "\n".join(lines)


def test_only_the_shared_vocabulary_sits_at_the_top() -> None:
    loose = sorted(
        p.name for p in ROOT.glob("*.py") if p.name not in ("__init__.py", "cli.py", "__main__.py")
    )
    assert len(loose) <= TOP_LEVEL_MODULES, loose


def test_no_two_files_share_a_name() -> None:
    # ``results.py`` holds each layer's boundary types: one meaning wherever it stands.
    shared = {"__init__.py", "results.py"}
    names: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        names.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    clashes = {n: ps for n, ps in names.items() if len(ps) > 1 and n not in shared}
    assert not clashes, clashes
