"""The house rules of the package, checked from its source: no import cycle, the layers point
one way, modules and functions stay a size one can read in a sitting, each says what it owns,
the README maps them, and classes compose instead of mixing in. Which parts may hold the whole
config is test_config_seams.py's."""

from __future__ import annotations

import ast
import pathlib

import pytest
from layout_tools import MODULES, PACKAGE, module_name, package_trees

MAX_LINES = 450

# Which subpackages each may import (besides itself and the top-level errors/logs).
# algo is the math: it knows nothing of Ray, actors, files or the driver.
LAYERS = {
    "config": set(),
    "algo": {"config"},
    "data": {"config"},
    "model": {"config", "algo", "data"},
    "observe": {"config", "algo", "persist"},  # the report reads a run from a bucket too
    "persist": {"config", "algo", "data", "model"},
    "runtime": {"config", "algo", "data", "model", "observe", "persist"},
    "driver": {"config", "algo", "data", "model", "observe", "persist", "runtime"},
    # A sweep runs whole jobs: it sizes them as the driver does and reads their records.
    "sweep": {"config", "observe", "persist", "driver"},
}


def imports(path: pathlib.Path) -> set[str]:
    """The package modules ``path`` imports, at module level or inside functions (imports
    under ``if TYPE_CHECKING:`` are for annotations only and do not count)."""
    tree = ast.parse(path.read_text())
    skipped = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped |= {id(n) for child in node.body for n in ast.walk(child)}
    found = set()
    for node in ast.walk(tree):
        if id(node) in skipped:
            continue
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("diloco_ray"):
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                found.add(full if full in MODULES else node.module)
        elif isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("diloco_ray")}
    return {m for m in found if m in MODULES} - {module_name(path)}


GRAPH = {name: imports(path) for name, path in MODULES.items()}


def test_no_import_cycle():
    cycles, done = [], set()

    def visit(node, stack):
        for dep in GRAPH[node]:
            if dep in stack:
                cycles.append(" -> ".join(stack[stack.index(dep) :] + [dep]))
            elif dep not in done:
                visit(dep, stack + [dep])
        done.add(node)

    for name in GRAPH:
        visit(name, [name])
    assert cycles == []


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_layers_point_one_way(package):
    allowed = LAYERS[package] | {package}
    wrong = sorted(
        f"{name} imports {dep}"
        for name, deps in GRAPH.items()
        if name.startswith(f"diloco_ray.{package}.")
        for dep in deps
        if dep.count(".") >= 2 and dep.split(".")[1] not in allowed
    )
    assert wrong == []


def test_the_math_imports_no_ray():
    offenders = sorted(
        name
        for name, path in MODULES.items()
        if name.startswith("diloco_ray.algo") and ("import ray" in path.read_text() or "from ray" in path.read_text())
    )
    assert offenders == []


def test_config_modules_need_no_type_checking_imports_of_each_other():
    """The config modules import one way (validation and sections read fields; schema builds on
    them): none imports another only for annotations, which is how an import cycle hides."""
    offenders = []
    for name, tree in package_trees("config").items():
        for node in ast.walk(tree):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for child in ast.walk(node):
                    if isinstance(child, ast.ImportFrom) and (child.module or "").startswith("diloco_ray"):
                        offenders.append(f"{name} imports {child.module} under TYPE_CHECKING")
                    elif isinstance(child, ast.Import):
                        offenders += [
                            f"{name} imports {a.name} under TYPE_CHECKING"
                            for a in child.names
                            if a.name.startswith("diloco_ray")
                        ]
    assert offenders == []


def test_every_module_is_readable_in_a_sitting():
    long = {name: n for name, path in MODULES.items() if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_every_module_says_what_it_owns():
    assert [name for name, path in MODULES.items() if ast.get_docstring(ast.parse(path.read_text())) is None] == []


def test_the_readme_layout_names_every_module():
    """The README's Layout section lists each subpackage and each module in it, so the map a
    newcomer reads is the house as built."""
    readme = (PACKAGE.parent / "README.md").read_text()
    layout = readme[readme.index("## Layout") :]
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
