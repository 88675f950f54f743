"""The import contracts hold: pyproject.toml's [tool.importlinter] (the layers point one way,
no import cycle, algo knows nothing of Ray), checked by import-linter as CI's ``lint-imports``
does, so that the README's test command enforces them too."""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The linter's own command, run from the repository root so it reads pyproject.toml; without
# its cache, so the test writes nothing into the working tree.
LINT_IMPORTS = "from importlinter.cli import lint_imports_command; lint_imports_command()"


def test_the_import_contracts_hold():
    done = subprocess.run(
        [sys.executable, "-c", LINT_IMPORTS, "--no-cache", "--no-logo"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"lint-imports failed:\n{done.stdout}{done.stderr}"
