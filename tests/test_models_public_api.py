"""The model users read first imports only what `fusedlayers` exports (and the public debug
module): a model of one's own can be built the same way."""

from __future__ import annotations

import ast
from pathlib import Path

import fusedlayers

MODELS = Path(__file__).resolve().parent.parent / "models"
PUBLIC_MODULES = {"fusedlayers", "fusedlayers.debug", "fusedlayers.models"}


def test_models_import_only_the_public_api():
    for path in sorted(MODELS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                if node.module.startswith("fusedlayers"):
                    assert node.module in PUBLIC_MODULES, f"{path.name}: from {node.module}"
                    if node.module == "fusedlayers":
                        missing = {a.name for a in node.names} - set(fusedlayers.__all__)
                        assert not missing, f"{path.name}: {missing} not in fusedlayers.__all__"
            if isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("fusedlayers.") or alias.name in (
                        PUBLIC_MODULES
                    ), f"{path.name}: import {alias.name}"
