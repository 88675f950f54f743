"""The house rules of the package, checked from its source: no import cycle, the layers point
one way, and modules stay a size one can read in a sitting."""

from __future__ import annotations

import ast
import pathlib

import pytest

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "diloco_ray"
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
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


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


def package_trees(package: str) -> dict[str, ast.Module]:
    return {
        name: ast.parse(path.read_text()) for name, path in MODULES.items() if name.startswith(f"diloco_ray.{package}.")
    }


# The packages below runtime/ receive typed config sections (config/sections.py) or plain
# values, never the whole config. A module that truly needs the whole of it goes in the
# allow-list with its reason; none does (config.yaml is written by the driver, and the
# tokenising task takes the data and model sections).
SECTION_TAKERS = ("algo", "data", "model", "persist")
WHOLE_CONFIG_ALLOWED: dict[str, str] = {}  # module -> why it needs the whole config


@pytest.mark.parametrize("package", SECTION_TAKERS)
def test_parts_below_runtime_never_see_the_whole_config(package):
    """No module of algo/, data/, model/ or persist/ imports the schema or TrainerConfig (not
    even for annotations under TYPE_CHECKING) nor names the class in code."""
    offenders = set()
    for name, tree in package_trees(package).items():
        if name in WHOLE_CONFIG_ALLOWED:
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("diloco_ray.config.schema"):
                offenders.add(f"{name} imports {node.module}")
            elif isinstance(node, ast.ImportFrom):
                offenders |= {f"{name} imports {a.name}" for a in node.names if a.name in ("schema", "TrainerConfig")}
            elif isinstance(node, ast.Import):
                offenders |= {
                    f"{name} imports {a.name}" for a in node.names if a.name.startswith("diloco_ray.config.schema")
                }
            elif isinstance(node, ast.Name) and node.id == "TrainerConfig":
                offenders.add(f"{name} names TrainerConfig")
            elif isinstance(node, ast.Attribute) and node.attr == "TrainerConfig":
                offenders.add(f"{name} names TrainerConfig")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value == "TrainerConfig":
                offenders.add(f"{name} names TrainerConfig in a string annotation")
    assert sorted(offenders) == []


@pytest.mark.parametrize("package", SECTION_TAKERS)
def test_no_part_below_runtime_takes_an_untyped_config(package):
    """A function in algo/, data/, model/ or persist/ takes the section it needs (or plain
    values), so a parameter named config or cfg says its type, and the type is not Any."""
    offenders = []
    for name, tree in package_trees(package).items():
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            a = node.args
            for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
                if arg is None or arg.arg.lower() not in ("config", "cfg", "conf", "settings"):
                    continue
                kind = ast.unparse(arg.annotation) if arg.annotation is not None else None
                if kind in (None, "Any", "typing.Any", "object", "'Any'"):
                    offenders.append(f"{name}.{node.name}({arg.arg}: {kind})")
    assert offenders == []


# In driver/ and observe/ each part takes the typed sections it reads (config/sections.py) or
# plain values. Only these may take or keep the whole config (a TrainerConfig, or every
# section at once), each for the reason given:
WHOLE_CONFIG_ALLOWED = {
    # builds every part from the config, ships it to the actors and writes config.yaml
    "diloco_ray.driver.trainer.DilocoFSDPTrainer",
    # checks the world around the whole config (files, folders, optimizer names) before Ray starts
    "diloco_ray.driver.preflight",
    # hands each loop the sections it reads, and no others
    "diloco_ray.driver.loop.loop_for",
}
WHOLE_CONFIG_CLASSES = {"TrainerConfig", "ConfigFields", "Sections"}
CONFIG_PARAMS = {"config", "cfg", "conf"}


def annotation_names(node: ast.AST) -> set[str]:
    """The names an annotation mentions, inside string annotations too."""
    names = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            names.add(n.id)
        elif isinstance(n, ast.Attribute):
            names.add(n.attr)
        elif isinstance(n, ast.Constant) and isinstance(n.value, str):
            try:
                names |= annotation_names(ast.parse(n.value, mode="eval"))
            except SyntaxError:
                pass
    return names


def whole_config_takers(tree: ast.Module) -> set[tuple[str, str]]:
    """``(qualified function, what)`` for each function of ``tree`` that takes a whole config (a
    parameter annotated with one of WHOLE_CONFIG_CLASSES, or an untyped one named ``config``)
    or keeps one (``self.config = ...``, ``self.cfg = ...``)."""
    found = set()
    for name, node in functions(tree):
        a = node.args
        for arg in filter(None, [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]):
            if arg.annotation is None:
                if arg.arg in CONFIG_PARAMS:
                    found.add((name, f"takes {arg.arg}: untyped"))
            elif annotation_names(arg.annotation) & WHOLE_CONFIG_CLASSES:
                found.add((name, f"takes {arg.arg}: {ast.unparse(arg.annotation)}"))
        for sub in ast.walk(node):
            if isinstance(sub, ast.Assign):
                targets = sub.targets
            elif isinstance(sub, (ast.AnnAssign, ast.AugAssign)):
                targets = [sub.target]
            else:
                continue
            for target in (t for top in targets for t in ast.walk(top)):
                if isinstance(target, ast.Attribute) and ast.unparse(target.value) == "self":
                    if target.attr in CONFIG_PARAMS:
                        found.add((name, f"keeps self.{target.attr}"))
    return found


@pytest.mark.parametrize("package", ["driver", "observe"])
def test_driver_and_observe_parts_take_their_sections_not_the_whole_config(package):
    """Membership, the checkpointer, the loops, the records, the outlets... each receive the
    sections (or values) they read; only WHOLE_CONFIG_ALLOWED may hold the whole config."""

    def allowed(where: str) -> bool:
        return any(where == ok or where.startswith(f"{ok}.") for ok in WHOLE_CONFIG_ALLOWED)

    offenders = sorted(
        f"{module}.{name} {what}"
        for module, tree in package_trees(package).items()
        for name, what in whole_config_takers(tree)
        if not allowed(f"{module}.{name}")
    )
    # An untyped parameter by another name is caught where its module reaches for the class:
    # only a module that holds an allowed name imports TrainerConfig (or the schema).
    holders = {
        module for module in MODULES if any(ok == module or ok.startswith(f"{module}.") for ok in WHOLE_CONFIG_ALLOWED)
    }
    offenders += sorted(
        f"{module} imports {alias.name}"
        for module, tree in package_trees(package).items()
        if module not in holders
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
        if alias.name in WHOLE_CONFIG_CLASSES - {"Sections"} or node.module == "diloco_ray.config.schema"
    )
    assert offenders == [], "parts that take or keep the whole config:\n" + "\n".join(offenders)


def test_the_driver_config_rule_sees_annotations_strings_and_self_config():
    source = (
        "def build(sections: Sections, steps: int): ...\n"
        "def log_for(config, folder: str): ...\n"
        "def fine(config: ObservabilitySection, run_config: dict): ...\n"
        "class Part:\n"
        "    def __init__(self, job: Optional['TrainerConfig'], membership: MembershipSection):\n"
        "        self.membership, self.config = membership, job\n"
        "    def later(self):\n"
        "        self.cfg: dict = {}\n"
    )
    assert whole_config_takers(ast.parse(source)) == {
        ("build", "takes sections: Sections"),
        ("log_for", "takes config: untyped"),
        ("Part.__init__", "takes job: Optional['TrainerConfig']"),
        ("Part.__init__", "keeps self.config"),
        ("Part.later", "keeps self.cfg"),
    }


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


# The actors of runtime/ build their parts from the whole config; every other class there
# (the parts they own) takes the typed section it reads (config/sections.py) or plain values.
WHOLE_CONFIG_HOLDERS = {
    "diloco_ray.runtime.rank.RankWorker",
    "diloco_ray.runtime.server.ParameterServer",
    "diloco_ray.runtime.replica.Replica",
    "diloco_ray.runtime.server_group.ServerGroup",
}
CONFIG_NAMES = {"config", "cfg", "conf"}
WHOLE_CONFIG_TYPES = {"TrainerConfig", "ConfigFields"}


def class_nodes(tree: ast.AST):
    """``(qualified class name, node)`` for every node inside a class, each counted for its
    innermost class (a nested class's body is its own)."""

    def visit(node: ast.AST, owner: str):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                yield from visit(child, f"{owner}.{child.name}" if owner else child.name)
            else:
                if owner:
                    yield owner, child
                yield from visit(child, owner)

    yield from visit(tree, "")


def whole_config_uses(tree: ast.AST) -> list[tuple[str, str]]:
    """``(class, what)`` for what the classes of ``tree`` do with a whole config: take a
    parameter named ``config`` (``cfg``) that is not a section, name TrainerConfig (in an
    annotation, a call), keep ``self.config``, or declare a ``config`` field."""
    found = []
    for owner, node in class_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            a = node.args
            for arg in filter(None, [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]):
                kind = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if arg.arg in CONFIG_NAMES and not kind.strip("'\"").endswith("Section"):
                    found.append((owner, f"{node.name} takes {arg.arg}: {kind or 'untyped'}"))
        elif isinstance(node, ast.Name) and node.id in WHOLE_CONFIG_TYPES:
            found.append((owner, f"names {node.id}"))
        elif isinstance(node, ast.Attribute) and node.attr in WHOLE_CONFIG_TYPES:
            found.append((owner, f"names {ast.unparse(node)}"))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in WHOLE_CONFIG_TYPES:
            found.append((owner, f"names {node.value} in a string annotation"))
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in (t for top in targets for t in ast.walk(top)):
                if isinstance(target, ast.Attribute) and target.attr in CONFIG_NAMES:
                    found.append((owner, f"keeps {ast.unparse(target)}"))
                elif isinstance(target, ast.Name) and target.id in CONFIG_NAMES and isinstance(node, ast.AnnAssign):
                    found.append((owner, f"declares a field {target.id}"))
    return found


def test_only_the_runtime_actors_hold_the_whole_config():
    """The rank worker, the parameter server, the replica and the server group build their parts
    from the whole TrainerConfig; each part (any other class of runtime/) receives only the
    section it reads, or plain values."""
    offenders = [
        f"{name}.{owner} {what}"
        for name, tree in sorted(package_trees("runtime").items())
        for owner, what in whole_config_uses(tree)
        if f"{name}.{owner}" not in WHOLE_CONFIG_HOLDERS
    ]
    assert offenders == [], "runtime parts that hold the whole config:\n" + "\n".join(offenders)


def test_the_whole_config_rule_sees_params_fields_and_tuple_assignments():
    source = (
        "class Part:\n"
        "    def __init__(self, data: DataSection, cfg):\n"
        "        self.data, self.config = data, cfg\n"
        "class Typed:\n"
        "    def __init__(self, config: 'DataSection', other: 'TrainerConfig'):\n"
        "        self.data = config\n"
        "    class Inner:\n"
        "        config: dict\n"
        "class Clean:\n"
        "    def __init__(self, data: DataSection, servers: int):\n"
        "        self.data, self.servers = data, servers\n"
    )
    assert whole_config_uses(ast.parse(source)) == [
        ("Part", "__init__ takes cfg: untyped"),
        ("Part", "keeps self.config"),
        ("Typed", "names TrainerConfig in a string annotation"),
        ("Typed.Inner", "declares a field config"),
    ]
