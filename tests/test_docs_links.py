"""Every relative link in the repository's markdown points at a file that exists (and, for
`file.md#anchor`, at a heading of that file), so moving or deleting a file cannot leave a dead
link behind in README.md, BENCHMARKS.md or docs/."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"build", "dist", "node_modules", "gpu-out"}

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$", re.MULTILINE)


def _markdown_files() -> list[Path]:
    files = []
    for path in sorted(ROOT.rglob("*.md")):
        parts = path.relative_to(ROOT).parts[:-1]
        if any(p.startswith(".") or p in SKIP_DIRS or p.endswith(".egg-info") for p in parts):
            continue
        files.append(path)
    return files


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans, where `](` is not a link."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _anchor(heading: str) -> str:
    """GitHub's anchor for a heading: link text kept, markup dropped, lower case, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    return {_anchor(h) for h in HEADING.findall(_prose(path.read_text(encoding="utf-8")))}


def _links(path: Path) -> list[str]:
    targets = LINK.findall(_prose(path.read_text(encoding="utf-8")))
    return [t for t in targets if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]  # http:, mailto:, ...


def test_markdown_files_found():
    names = {p.relative_to(ROOT).as_posix() for p in _markdown_files()}
    assert {"README.md", "BENCHMARKS.md", "docs/performance.md"} <= names


@pytest.mark.parametrize("md", _markdown_files(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(md: Path):
    dead = []
    for target in _links(md):
        file_part, _, anchor = target.partition("#")
        dest = (md.parent / file_part).resolve() if file_part else md
        if not dest.exists():
            dead.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            dead.append(f"{target} (no heading #{anchor})")
    assert not dead, f"{md.relative_to(ROOT)}: dead links: {dead}"


def test_anchor_matches_github():
    assert _anchor("State on 2026-11-23 (run 7, [BENCHMARKS.md](../BENCHMARKS.md))") == (
        "state-on-2026-11-23-run-7-benchmarksmd"
    )
    assert _anchor("Host time per attention call") == "host-time-per-attention-call"
