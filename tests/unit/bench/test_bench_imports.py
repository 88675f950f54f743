"""bench/'s scripts and its wanlab package import one way: no circle, counting the imports
made inside functions (a deferred import is still a dependency)."""

from __future__ import annotations

import ast
import pathlib

BENCH = pathlib.Path(__file__).resolve().parents[3] / "bench"


def module_names() -> dict[str, pathlib.Path]:
    names = {p.stem: p for p in BENCH.glob("*.py")}
    for package in (p for p in BENCH.iterdir() if (p / "__init__.py").exists()):
        names[package.name] = package / "__init__.py"
        names.update({f"{package.name}.{p.stem}": p for p in package.glob("*.py") if p.stem != "__init__"})
    return names


def imports_of(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """The bench modules ``name`` imports, wherever in the file the import is."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(filter(None, [package, base]))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m in known and m != name}


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle in ``graph`` (module -> the modules it imports), or []."""
    state: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(node: str, path: list[str]) -> list[str]:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := walk(nxt, path + [nxt])):
                return found
        state[node] = 2
        return []

    for start in sorted(graph):
        if start not in state and (found := walk(start, [start])):
            return found
    return []


def test_the_cycle_finder_finds_a_deferred_circle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) == []


def test_bench_imports_one_way():
    names = module_names()
    assert "wan" in names and "wanlab.netns" in names
    graph = {name: imports_of(name, path, set(names)) for name, path in names.items()}
    assert graph["wanlab.layouts"] >= {"wanlab.rehearsal", "wanlab.router", "wanlab.bridge"}
    assert cycle(graph) == [], " -> ".join(cycle(graph))
