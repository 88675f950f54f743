"""The house rules of the package that no linter states, checked from its source: modules and
functions stay a size one can read in a sitting, docs/layout.md maps them, and classes compose
instead of mixing in. The import contracts (the layers point one way, no cycle, algo knows no
Ray) are pyproject.toml's [tool.importlinter], run by test_layers.py; the docstrings and the
complexity limits are ruff's (pyproject.toml's [tool.ruff.lint]); which parts may hold the
whole config is test_config_seams.py's."""

from __future__ import annotations

import ast
import pathlib

from layout_tools import MODULES, PACKAGE

MAX_LINES = 450


def test_every_module_is_readable_in_a_sitting():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_the_layout_page_names_every_module():
    """The layout page (docs/layout.md, which the README links) lists each subpackage and each
    module in it, so the map a newcomer reads is the house as built."""
    layout = (PACKAGE.parent / "docs" / "layout.md").read_text()
    missing = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.name == "__init__.py":
            if len(rel.parts) > 1 and f"  {rel.parts[0]}/" not in layout:
                missing.append(f"{rel.parts[0]}/")
        elif rel.name != "__main__.py" and rel.name not in layout:
            missing.append(str(rel))
    assert missing == []


def test_test_modules_have_unique_basenames():
    # The tests folders have no __init__.py, so pytest imports each test module by its basename:
    # two files with one name fail collection of the whole suite.
    tests = PACKAGE.parent / "tests"
    seen: dict[str, pathlib.Path] = {}
    for path in sorted(tests.rglob("test_*.py")):
        assert path.name not in seen, f"{path} and {seen[path.name]} share a basename"
        seen[path.name] = path


MAX_FUNCTION_LINES = 60


def functions(tree: ast.Module, outer: str = ""):
    """``(qualified name, def node)`` of every function in ``tree``: methods as ``Class.name``,
    nested functions as ``outer.name``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{outer}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield name, node
            yield from functions(node, f"{name}.")
        else:
            yield from functions(node, outer)


def test_no_function_is_longer_than_60_lines():
    """A function is read in one go: from its ``def`` line to its last line (docstring and
    comments included, decorators not) it is at most 60 lines."""
    long = sorted(
        (n, f"{path.relative_to(PACKAGE.parent)}: {name}")
        for path in MODULES.values()
        for name, node in functions(ast.parse(path.read_text()))
        if (n := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    )
    assert long == [], "functions over 60 lines:\n" + "\n".join(f"{n:4d} {where}" for n, where in reversed(long))


def project_classes() -> dict[str, set[str]]:
    """Module -> the names of the classes defined at its top level (and in its functions)."""
    return {
        name: {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)}
        for name, path in MODULES.items()
    }


def project_bases(tree: ast.Module, module: str, classes: dict[str, set[str]]):
    """``(class name, [its bases that are classes of the package])`` for every class in ``tree``,
    each base spelled ``module.Class``.

    A base is the package's when it is a class of this module, a name imported from a
    package module that defines it (``from diloco_ray.x import C``, any alias), or an
    attribute of an imported package module (``x.C``, ``diloco_ray.x.C``); ``C[...]`` counts as ``C``.
    """
    names = {c: f"{module}.{c}" for c in classes[module]}  # local name -> the class it is
    modules: dict[str, str] = {}  # local name -> package module
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diloco_ray"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                if full in classes:
                    modules[alias.asname or alias.name] = full
                elif alias.name in classes.get(node.module, ()):
                    names[alias.asname or alias.name] = full
        elif isinstance(node, ast.Import):
            modules |= {alias.asname or alias.name: alias.name for alias in node.names if alias.name in classes}

    def project_class(base: ast.expr) -> str | None:
        if isinstance(base, ast.Subscript):
            return project_class(base.value)
        if isinstance(base, ast.Name):
            return names.get(base.id)
        if isinstance(base, ast.Attribute):
            owner = modules.get(ast.unparse(base.value), ast.unparse(base.value))
            return f"{owner}.{base.attr}" if base.attr in classes.get(owner, ()) else None
        return None

    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            yield node.name, [c for c in map(project_class, node.bases) if c is not None]


def test_no_class_inherits_from_two_project_classes():
    """Composition, not mixins: a class has at most one base class of the package's own, and
    no class is a *Mixin."""
    classes = project_classes()
    offenders = []
    for module, path in sorted(MODULES.items()):
        for name, bases in project_bases(ast.parse(path.read_text()), module, classes):
            if len(bases) >= 2:
                offenders.append(f"{module}.{name} inherits from {', '.join(bases)}")
            if name.endswith("Mixin"):
                offenders.append(f"{module}.{name} is a mixin")
    assert offenders == [], "classes built from several of the package's classes:\n" + "\n".join(offenders)


def test_the_class_rule_sees_through_aliases_modules_and_generics():
    classes = {"diloco_ray.a": {"A", "B"}, "diloco_ray.b": {"Local"}}
    source = (
        "from diloco_ray import a\nfrom diloco_ray.a import A as Alias\nimport diloco_ray.a\n"
        "class Local: ...\n"
        "class One(Alias, dict): ...\n"
        "class Two(a.B, Local): ...\n"
        "class Three(Alias[int], diloco_ray.a.B, Local): ...\n"
    )
    found = dict(project_bases(ast.parse(source), "diloco_ray.b", classes))
    assert found == {
        "Local": [],
        "One": ["diloco_ray.a.A"],
        "Two": ["diloco_ray.a.B", "diloco_ray.b.Local"],
        "Three": ["diloco_ray.a.A", "diloco_ray.a.B", "diloco_ray.b.Local"],
    }
