"""Every ``from shoal... import name`` in the examples names something that exists, including the
imports inside ``if __name__ == "__main__":`` blocks, which no other test runs (a renamed helper
once broke the README's Flower example only at its command line)."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def test_every_shoal_import_in_the_examples_resolves() -> None:
    missing = []
    files = sorted(EXAMPLES.rglob("*.py"))
    assert files
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "shoal":
                module = importlib.import_module(node.module)
                missing += [f"{path.name}: {node.module}.{a.name}" for a in node.names if not hasattr(module, a.name)]
    assert not missing, missing
