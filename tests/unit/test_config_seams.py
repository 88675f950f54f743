"""The config seams, checked from the source: a part takes the typed section it reads
(config/sections.py) or plain values, never the whole TrainerConfig. One walker finds every
way code reaches for the whole config; one allow-list names, per package, who may."""

from __future__ import annotations

import ast

import pytest
from layout_tools import MODULES, package_trees

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
        "diloco_ray.driver.preflight": "checks files, folders and optimizer names before Ray starts",
        "diloco_ray.driver.loop.loop_for": "hands each loop the sections it reads, and no others",
    },
    # Records, metrics and the report each take the sections (or values) they read.
    "observe": {},
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
