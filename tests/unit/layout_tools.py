"""The package's modules and their syntax trees, shared by the source-reading tests
(test_layout.py, test_config_seams.py). Not a test module: pytest puts this folder on the
path for the test modules in it, so they import it by name."""

from __future__ import annotations

import ast
import pathlib

PACKAGE = pathlib.Path(__file__).resolve().parents[2] / "diloco_ray"


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def package_trees(package: str) -> dict[str, ast.Module]:
    """Module name -> parsed source, for every module of ``diloco_ray.<package>``."""
    return {
        name: ast.parse(path.read_text()) for name, path in MODULES.items() if name.startswith(f"diloco_ray.{package}.")
    }
