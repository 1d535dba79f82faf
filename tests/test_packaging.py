"""Both `pip install .` and `pip install -e .` put kernels/ and models/ under the fusedlayers
namespace and never install a top-level `kernels` or `models` module (PyPI has a popular
`kernels` distribution that would clash). The subpackages fusedlayers.attention and
fusedlayers.layers install too (pyproject lists every package by name)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROBE = (
    "import importlib.util, fusedlayers.kernels as k, fusedlayers.models as m;"
    "import fusedlayers.attention.frontend, fusedlayers.layers.transformer_layer;"
    "print(k.__file__); print(m.__file__);"
    "print(importlib.util.find_spec('kernels'), importlib.util.find_spec('models'))"
)


def _probe(env=None, cwd="/"):
    result = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=cwd, env=env, check=True
    )
    return result.stdout.strip().split("\n")


def test_editable_or_installed_environment_maps_the_namespace():
    kernels_file, models_file, top_level = _probe()
    assert Path(kernels_file).parent.name in ("kernels",)
    assert Path(kernels_file).parent.parent.name in ("fusedlayers", ROOT.name)
    assert Path(models_file).parent.name == "models"
    assert top_level == "None None"


@pytest.mark.slow
def test_regular_install_maps_the_namespace(tmp_path):
    target = tmp_path / "site"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "--target",
            str(target),
            str(ROOT),
        ],
        check=True,
        capture_output=True,
        cwd=tmp_path,
    )
    assert (target / "fusedlayers" / "kernels" / "__init__.py").exists()
    assert (target / "fusedlayers" / "models" / "__init__.py").exists()
    for subpackage in ("attention", "layers"):
        assert (target / "fusedlayers" / subpackage / "__init__.py").exists(), subpackage
    assert not (target / "kernels").exists() and not (target / "models").exists()
    env = {**os.environ, "PYTHONPATH": str(target)}
    kernels_file, models_file, top_level = _probe(env=env, cwd=tmp_path)
    assert kernels_file.startswith(str(target)) and models_file.startswith(str(target))
    assert top_level == "None None"
