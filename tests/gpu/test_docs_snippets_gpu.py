"""The documentation's CUDA blocks (`<!-- snippet: cuda -->`, and blocks continuing one) run in full
on the GPU, and its `<!-- snippet: torchrun N -->` scripts under torchrun on N GPUs; the CPU suite
only resolves their names."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from docs_snippets import all_snippets, run_chain

pytestmark = pytest.mark.gpu

SNIPPETS = all_snippets()
CUDA_BLOCKS = [s for s in SNIPPETS if s.kind == "cuda"]
TORCHRUN_BLOCKS = [s for s in SNIPPETS if s.kind == "torchrun"]


@pytest.mark.parametrize("snippet", CUDA_BLOCKS, ids=lambda s: s.id)
def test_cuda_snippet_runs(snippet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_chain(snippet, SNIPPETS)


@pytest.mark.multi_gpu
@pytest.mark.parametrize("snippet", TORCHRUN_BLOCKS, ids=lambda s: s.id)
def test_torchrun_snippet_runs(snippet, tmp_path):
    gpus = int(snippet.target)
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA GPUs")
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    command += [f"--nproc_per_node={gpus}", str(script)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{snippet.id} under torchrun:\n{done.stdout}\n{done.stderr}"
