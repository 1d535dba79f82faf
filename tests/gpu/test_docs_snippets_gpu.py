"""The documentation's CUDA blocks (`<!-- snippet: cuda -->`, and blocks continuing one) run in full
on the GPU; the CPU suite only resolves their names."""

from __future__ import annotations

import pytest
from docs_snippets import all_snippets, run_chain

pytestmark = pytest.mark.gpu

SNIPPETS = all_snippets()
CUDA_BLOCKS = [s for s in SNIPPETS if s.kind == "cuda"]


@pytest.mark.parametrize("snippet", CUDA_BLOCKS, ids=lambda s: s.id)
def test_cuda_snippet_runs(snippet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_chain(snippet, SNIPPETS)
