"""The config seams, checked from the source: a part takes the typed section it reads
(config/sections.py) or plain values, never the whole TrainerConfig. One walker finds every
way code reaches for the whole config; one allow-list names, per package, who may. A second
walker finds reads of a field off the whole config in driver/ and runtime/, which even a
holder may not do: it ships the config, cuts it into sections and reads those. And each
field is declared once, in the table (config/fields.py), which the sections are built from."""

from __future__ import annotations

import ast
import dataclasses

import pytest
from layout_tools import MODULES, PACKAGE, package_trees

from diloco_ray.config.fields import FIELD_NAMES, FIELDS, SECTION_NAMES, DerivedValues
from diloco_ray.config.sections import SECTION_CLASSES, Sections

# The whole config, under any of its names: the class, the table of fields it is built on,
# and every section at once.
WHOLE_CONFIG_TYPES = {"TrainerConfig", "ConfigFields", "Sections"}
# The names a parameter or attribute that holds a config goes by.
CONFIG_NAMES = {"config", "cfg", "conf", "settings"}

# Per package, the only places (a module, a class or a function, spelled in full) that may
# hold the whole config, each with its reason. Everything else below them takes sections.
WHOLE_CONFIG_HOLDERS: dict[str, dict[str, str]] = {
    # Below runtime/ nothing does: config.yaml is written by the driver, and the tokenising
    # task takes the data and model sections.
    "algo": {},
    "data": {},
    "model": {},
    "persist": {},
    # The actors build their parts from the whole config (shipped as a dict, so it pickles);
    # each part they own takes the section it reads.
    "runtime": {
        "diloco_ray.runtime.rank.RankWorker": "builds the rank's model, batches, sync and state",
        "diloco_ray.runtime.server.ParameterServer": "builds the server's store, codec and outbox",
        "diloco_ray.runtime.replica.Replica": "places the replica's ranks and hands each the config",
        "diloco_ray.runtime.server_group.ServerGroup": "starts the servers, each with the config",
    },
    "driver": {
        "diloco_ray.driver.trainer.DilocoFSDPTrainer": "builds every part, ships the config, writes config.yaml",
        "diloco_ray.driver.preflight.check": "cuts the config into the sections each pre-Ray check reads",
        "diloco_ray.driver.loop.loop_for": "hands each loop the sections it reads, and no others",
    },
    # Records, metrics and the report each take the sections (or values) they read.
    "observe": {},
    "regions": {
        "diloco_ray.regions.agent": "builds the region's own view of the home's job, as the trainer builds its parts",
        "diloco_ray.regions.mirror": "builds the region's copy of the home's servers, each with the home's job",
    },
}


def type_names(annotation: ast.AST | None) -> set[str]:
    """The names an annotation mentions, inside string annotations too."""
    names = set()
    for node in ast.walk(annotation) if annotation is not None else ():
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            try:
                names |= type_names(ast.parse(node.value, mode="eval"))
            except SyntaxError:
                pass
    return names


def says_a_section(annotation: ast.AST | None) -> bool:
    """Whether a parameter named config says which section it is (not untyped, Any, object or
    a plain dict: what the whole config travels as)."""
    return any(name.endswith("Section") for name in type_names(annotation))


class WholeConfigFinder(ast.NodeVisitor):
    """``(where, what)`` for each reach for the whole config in a module: ``where`` is the
    enclosing ``Class.function`` (``<module>`` for module-level code; "" for imports, which
    count for the module wherever they stand).

    It finds: imports of TrainerConfig, ConfigFields or config.schema (under TYPE_CHECKING
    too); parameters annotated with one of WHOLE_CONFIG_TYPES (string annotations too);
    parameters named config (cfg, conf, settings) that do not say which section they are
    (untyped, Any, object, dict...); any other mention of those types in code; stores to
    ``x.config`` (tuple targets too); fields (and annotated locals) named config; and reads
    of ``self.config`` (a mixin using what its host keeps).
    """

    def __init__(self):
        self.scope: list[str] = []
        self.found: set[tuple[str, str]] = set()

    def report(self, what: str, module_level: bool = False) -> None:
        self.found.add(("" if module_level else ".".join(self.scope) or "<module>", what))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            if alias.name.startswith("diloco_ray.config.schema"):
                self.report(f"imports {alias.name}", module_level=True)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if (node.module or "").startswith("diloco_ray.config.schema"):
            self.report(f"imports {node.module}", module_level=True)
        for alias in node.names:
            if alias.name in {"schema", "TrainerConfig", "ConfigFields"}:
                self.report(f"imports {alias.name}", module_level=True)

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        # ``config: X`` in a class body is a (dataclass) field; in a function, a local.
        if isinstance(node.target, ast.Name) and node.target.id in CONFIG_NAMES:
            self.report(f"declares {node.target.id}: {ast.unparse(node.annotation)}")
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.scope.append(node.name)
        a = node.args
        for arg in filter(None, [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]):
            kind = ast.unparse(arg.annotation) if arg.annotation is not None else "untyped"
            if type_names(arg.annotation) & WHOLE_CONFIG_TYPES:
                self.report(f"takes {arg.arg}: {kind}")
            elif arg.arg.lower() in CONFIG_NAMES and not says_a_section(arg.annotation):
                self.report(f"takes {arg.arg}: {kind}")
        # The parameters are judged above; the body, defaults, decorators and return type below.
        for child in [*node.body, *node.decorator_list, *a.defaults, *a.kw_defaults, node.returns]:
            if child is not None:
                self.visit(child)
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in WHOLE_CONFIG_TYPES:
            self.report(f"names {node.id}")

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in WHOLE_CONFIG_TYPES:
            self.report(f"names {ast.unparse(node)}")
        if isinstance(node.ctx, ast.Store) and node.attr in CONFIG_NAMES:
            self.report(f"keeps {ast.unparse(node)}")
        elif isinstance(node.value, ast.Name) and node.value.id == "self" and node.attr in CONFIG_NAMES:
            self.report(f"reads {ast.unparse(node)}")  # a mixin reading what its host keeps
        self.generic_visit(node)

    def visit_Constant(self, node: ast.Constant) -> None:
        if isinstance(node.value, str) and len(node.value) < 200:
            for name in sorted(type_names(node) & WHOLE_CONFIG_TYPES):
                self.report(f"names {name} in a string annotation")


def whole_config_uses(tree: ast.AST) -> set[tuple[str, str]]:
    finder = WholeConfigFinder()
    finder.visit(tree)
    return finder.found


def offences(trees: dict[str, ast.AST], holders: dict[str, str]) -> list[str]:
    """What the modules ``trees`` do with the whole config outside ``holders``. An import is
    allowed in a module that has a holder."""

    def allowed(module: str, where: str) -> bool:
        if not where:
            return any(h == module or h.startswith(f"{module}.") for h in holders)
        full = f"{module}.{where}"
        return any(full == h or full.startswith(f"{h}.") or module == h for h in holders)

    return sorted(
        f"{module}{'.' + where if where else ''} {what}"
        for module, tree in trees.items()
        for where, what in whole_config_uses(tree)
        if not allowed(module, where)
    )


@pytest.mark.parametrize("package", sorted(WHOLE_CONFIG_HOLDERS))
def test_parts_take_their_sections_not_the_whole_config(package):
    """Only the holders named in WHOLE_CONFIG_HOLDERS take, keep or name the whole config."""
    trees = package_trees(package)
    if f"diloco_ray.{package}" in MODULES:
        trees[f"diloco_ray.{package}"] = ast.parse(MODULES[f"diloco_ray.{package}"].read_text())
    found = offences(trees, WHOLE_CONFIG_HOLDERS[package])
    assert found == [], "parts that hold the whole config:\n" + "\n".join(found)


def test_every_allowed_holder_exists():
    """An allow-list entry names a module, or a class or function in one, of its package."""
    for package, holders in WHOLE_CONFIG_HOLDERS.items():
        for holder in holders:
            module = max((m for m in MODULES if holder == m or holder.startswith(f"{m}.")), key=len)
            assert module.startswith(f"diloco_ray.{package}."), holder
            if holder != module:
                tree = ast.parse(MODULES[module].read_text())
                defined = {n.name for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
                assert holder[len(module) + 1 :].split(".")[0] in defined, holder


def test_the_walker_sees_every_way_to_hold_the_whole_config():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from diloco_ray.config.sections import DataSection, Sections\n"
        "if TYPE_CHECKING:\n"
        "    from diloco_ray.config.schema import TrainerConfig\n"
        "import diloco_ray.config.schema\n"
        "from diloco_ray.config import schema\n"
        "def build(sections: Sections, steps: int): ...\n"
        "def log_for(config, folder: str): ...\n"
        "def loose(cfg: Any, settings: object, conf: dict): ...\n"
        "def fine(config: 'DataSection', data: DataSection, run_config: dict): ...\n"
        "def make(job):\n"
        "    return schema.TrainerConfig(**job)\n"
        "class Part:\n"
        "    def __init__(self, job: Optional['TrainerConfig'], data: DataSection):\n"
        "        self.data, (self.config, *rest) = data, job\n"
        "    def later(self, fields: 'ConfigFields'):\n"
        "        self.cfg: dict = {}\n"
        "        return self.config.seq_len\n"
        "    class Inner:\n"
        "        config: DataSection\n"
        "class Holder:\n"
        "    def __init__(self, config: dict):\n"
        "        self.config = TrainerConfig(**config)\n"
    )
    tree = ast.parse(source)
    assert whole_config_uses(tree) == {
        ("", "imports TrainerConfig"),
        ("", "imports diloco_ray.config.schema"),
        ("", "imports schema"),
        ("build", "takes sections: Sections"),
        ("log_for", "takes config: untyped"),
        ("loose", "takes cfg: Any"),
        ("loose", "takes settings: object"),
        ("loose", "takes conf: dict"),
        ("make", "names schema.TrainerConfig"),
        ("Part.__init__", "takes job: Optional['TrainerConfig']"),
        ("Part.__init__", "keeps self.config"),
        ("Part.later", "takes fields: 'ConfigFields'"),
        ("Part.later", "keeps self.cfg"),
        ("Part.later", "reads self.config"),
        ("Part.Inner", "declares config: DataSection"),
        ("Holder.__init__", "takes config: dict"),
        ("Holder.__init__", "keeps self.config"),
        ("Holder.__init__", "names TrainerConfig"),
    }
    # An allowed holder passes, and its module may import the class; everything else does not.
    found = offences({"m": tree}, {"m.Holder": "the self-test's holder"})
    assert not any(line.startswith(("m.Holder", "m imports")) for line in found)
    assert "m.Part.__init__ keeps self.config" in found and "m.build takes sections: Sections" in found


# --- reads of a field off the whole config ----------------------------------------------

# What a part reads off a config: its fields, and the values derived from them.
FIELD_READS = set(FIELD_NAMES) | {name for name in vars(DerivedValues) if not name.startswith("_")}
# The packages whose holders keep the whole config: there, a holder ships it (``to_dict()``,
# ``for_replica()``, ``to_yaml()``), cuts it (``sections()``) or hands it on, and reads its
# fields off the sections like every other part.
READ_PACKAGES = ("driver", "runtime")


class FieldReadFinder(ast.NodeVisitor):
    """``(where, line, what)`` for each read of a config field, or of a value derived from
    fields, off a whole config: ``<name>.<field>`` for a name of CONFIG_NAMES,
    ``self.<name>.<field>``, and ``getattr(<name>, ...)``. A name of CONFIG_NAMES that its
    function takes annotated as a section is that section, and reading it is what sections
    are for."""

    def __init__(self):
        self.scope: list[str] = []
        self.section_params: list[set[str]] = []
        self.found: list[tuple[str, int, str]] = []

    def is_whole_config(self, node: ast.AST) -> bool:
        if isinstance(node, ast.Name):
            return node.id in CONFIG_NAMES and not any(node.id in names for names in self.section_params)
        return (
            isinstance(node, ast.Attribute)
            and node.attr in CONFIG_NAMES
            and isinstance(node.value, ast.Name)
            and node.value.id == "self"
        )

    def report(self, node: ast.AST, what: str) -> None:
        self.found.append((".".join(self.scope) or "<module>", node.lineno, what))

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        a = node.args
        params = filter(None, [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg])
        self.scope.append(node.name)
        self.section_params.append({p.arg for p in params if p.arg in CONFIG_NAMES and says_a_section(p.annotation)})
        self.generic_visit(node)
        self.section_params.pop()
        self.scope.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if node.attr in FIELD_READS and self.is_whole_config(node.value):
            self.report(node, f"reads {ast.unparse(node)}")
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name) and node.func.id == "getattr" and node.args:
            if self.is_whole_config(node.args[0]):
                self.report(node, f"reads {ast.unparse(node)}")
        self.generic_visit(node)


def field_reads(tree: ast.AST) -> list[tuple[str, int, str]]:
    finder = FieldReadFinder()
    finder.visit(tree)
    return finder.found


@pytest.mark.parametrize("package", READ_PACKAGES)
def test_parts_read_fields_off_their_sections_not_off_the_whole_config(package):
    """No part of driver/ or runtime/ reads a field off the whole config, holders included:
    ``self.sections = config.sections()`` once (or a section handed in), then
    ``self.sections.membership.call_timeout_s``."""
    found = sorted(
        (module, line, f"{MODULES[module].relative_to(PACKAGE.parent)}:{line} {where} {what}")
        for module, tree in package_trees(package).items()
        for where, line, what in field_reads(tree)
    )
    per_module: dict[str, int] = {}
    for module, _, _ in found:
        per_module[module] = per_module.get(module, 0) + 1
    summary = ", ".join(f"{module} ({n})" for module, n in sorted(per_module.items()))
    assert found == [], (
        f"{len(found)} reads of a config field off the whole config, in {summary}; read each off "
        "the part's section (config.sections().<section>.<field>) instead:\n" + "\n".join(line for *_, line in found)
    )


def test_the_read_walker_sees_every_read_off_a_whole_config():
    source = (
        "def plain(config, cfg: 'TrainerConfig', spec):\n"
        "    return config.lr, cfg.replica_bounds, cfg.ranks_of(1), getattr(config, 'seed'), spec.lr\n"
        "def shipped(config):\n"
        "    return config.to_dict(), config.sections().data.seq_len, config.for_replica(0)\n"
        "def cut(config: 'DataSection', data: DataSection):\n"
        "    return config.seq_len, data.seq_len, getattr(config, 'seed')\n"
        "class Holder:\n"
        "    def __init__(self, config):\n"
        "        self.config, self.data = config, config.sections().data\n"
        "    def later(self):\n"
        "        return self.config.max_steps, self.data.max_steps, self.cfg.seed, self.model.config.lr\n"
    )
    assert field_reads(ast.parse(source)) == [
        ("plain", 2, "reads config.lr"),
        ("plain", 2, "reads cfg.replica_bounds"),
        ("plain", 2, "reads cfg.ranks_of"),
        ("plain", 2, "reads getattr(config, 'seed')"),
        ("Holder.later", 11, "reads self.config.max_steps"),
        ("Holder.later", 11, "reads self.cfg.seed"),
    ]


# --- each field declared once ------------------------------------------------------------


def test_no_field_is_declared_twice():
    """A field is a class-body annotation once in all of config/: in the table. The sections
    are built from it, never re-declared."""
    declared: dict[str, list[str]] = {}
    for path in sorted((PACKAGE / "config").glob("*.py")):
        for cls in [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ClassDef)]:
            for stmt in cls.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    if stmt.target.id in FIELD_NAMES:
                        declared.setdefault(stmt.target.id, []).append(f"{path.name}:{cls.name}")
    twice = {name: where for name, where in declared.items() if len(where) > 1}
    assert twice == {}
    assert sorted(declared) == sorted(FIELD_NAMES)


def test_each_section_carries_exactly_the_fields_the_table_gives_it():
    assert [part.name for part in dataclasses.fields(Sections)] == list(SECTION_NAMES)
    assert sorted(SECTION_CLASSES) == sorted(SECTION_NAMES)
    for name in SECTION_NAMES:
        table = [f.name for f in FIELDS.values() if name in f.metadata["sections"]]
        assert [f.name for f in dataclasses.fields(SECTION_CLASSES[name])] == table, name
    assert all(f.metadata["sections"] for f in FIELDS.values())
