"""Every Python block in README.md and docs/*.md works on the CPU (tests/docs_snippets.py says how
each kind of block is checked), so a documented name or argument that does not exist fails here."""

from __future__ import annotations

import pytest
from docs_snippets import (
    Snippet,
    all_snippets,
    check_names,
    check_signature,
    documented_parameters,
    run_chain,
)

SNIPPETS = all_snippets()


def test_every_doc_has_blocks_found():
    """The collector sees the blocks (a broken fence pattern would make every test vacuous)."""
    files = {s.path.name for s in SNIPPETS}
    assert {"README.md", "gpt.md", "layers.md", "internals.md"} <= files
    assert len(SNIPPETS) >= 12


@pytest.mark.parametrize("snippet", SNIPPETS, ids=lambda s: s.id)
def test_snippet(snippet: Snippet, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # whatever a block writes lands in a scratch folder
    if snippet.kind == "signature":
        check_signature(snippet)
    elif snippet.kind in ("cuda", "torchrun") or _continues_a_cuda_block(snippet):
        check_names(snippet.code)
    else:
        run_chain(snippet, SNIPPETS)


def _continues_a_cuda_block(snippet: Snippet) -> bool:
    if snippet.kind != "continues":
        return False
    same_file = [s for s in SNIPPETS if s.path == snippet.path and s.line < snippet.line]
    head = next(s for s in reversed(same_file) if s.kind != "continues")
    return head.kind == "cuda"


def test_check_names_catches_a_missing_name():
    with pytest.raises(ImportError):
        check_names("from fusedlayers import NoSuchLayer\n")
    with pytest.raises(AttributeError):
        check_names("import fusedlayers\nx = fusedlayers.no_such_function(1)\n")


def test_signature_check_catches_a_wrong_parameter(tmp_path):
    code = "f(q, k,  # comment, with a comma\n  *, scale: float = 1.0, window=(-1, -1))"
    assert documented_parameters(code, "f") == [
        ("q", None),
        ("k", None),
        ("scale", "1.0"),
        ("window", "(-1, -1)"),
    ]

    def block(code: str) -> Snippet:
        return Snippet(tmp_path / "x.md", 1, "signature", "math.isclose", code)

    right = "isclose(a, b, *, rel_tol=1e-09, abs_tol=0.0)"
    check_signature(block(right))
    with pytest.raises(AssertionError, match="takes"):
        check_signature(block("isclose(a, b, *, rel_tol=1e-09)"))
    with pytest.raises(AssertionError, match="default"):
        check_signature(block(right.replace("abs_tol=0.0", "abs_tol=1.0")))
