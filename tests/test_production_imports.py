"""Production code (lnstrain/, launch/, tools/) never imports ``lnstrain.testing``: what a launcher or a
benchmark needs from it lives in a production module."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def test_production_code_does_not_import_lnstrain_testing():
    production = [path for folder in ("lnstrain", "launch", "tools") for path in (REPO / folder).rglob("*.py")
                  if (REPO / "lnstrain" / "testing") not in path.parents]
    assert len(production) > 50
    offenders = {str(path.relative_to(REPO)): sorted(m for m in imported_modules(path)
                                                     if m == "lnstrain.testing" or m.startswith("lnstrain.testing."))
                 for path in production}
    assert {path: modules for path, modules in offenders.items() if modules} == {}
