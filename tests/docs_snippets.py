"""The Python blocks of README.md and docs/*.md, and how each is checked.

A block is checked by the kind named in an HTML comment on the line before its fence (invisible
when the markdown renders); without one it must run as written on the CPU:

    <!-- snippet: cuda -->           needs a CUDA GPU. On the CPU its imports run and every
                                     `fusedlayers...` name it uses must exist; tests/gpu runs it
                                     in full.
    <!-- snippet: torchrun N -->     a script for `torchrun --nproc_per_node N`, on N CUDA GPUs
                                     of one host. On the CPU its names are resolved as for
                                     `cuda`; tests/gpu launches it when the host has N GPUs.
    <!-- snippet: continues -->      runs in the namespace the file's previous block left.
    <!-- snippet: signature NAME --> lists the parameters of the callable NAME (a dotted import
                                     path) as a call; the names, their order and every literal
                                     default must be the callable's.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import re
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DOC_FILES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
KINDS = ("run", "cuda", "torchrun", "continues", "signature")

_FENCE = re.compile(r"^```python\s*$")
_MARKER = re.compile(r"^<!--\s*snippet:\s*(\w+)\s*(\S*)\s*-->\s*$")


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # 1-based line of the opening fence
    kind: str
    target: str  # the callable of a signature block, the GPU count of a torchrun block, else ""
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.name}:{self.line}"


def snippets(path: Path) -> list[Snippet]:
    """Every ```python block of `path` with the kind its marker names."""
    lines = path.read_text().splitlines()
    found, i = [], 0
    while i < len(lines):
        if not _FENCE.match(lines[i]):
            i += 1
            continue
        marker = _MARKER.match(lines[i - 1]) if i else None
        kind, target = (marker.group(1), marker.group(2)) if marker else ("run", "")
        if kind not in KINDS:
            raise ValueError(f"{path.name}:{i}: unknown snippet kind {kind!r}; one of {KINDS}")
        if kind == "torchrun" and not target.isdigit():
            raise ValueError(f"{path.name}:{i}: torchrun needs a GPU count, got {target!r}")
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
        if end is None:
            raise ValueError(f"{path.name}:{i + 1}: a ```python block is never closed")
        found.append(Snippet(path, i + 1, kind, target, "\n".join(lines[i + 1 : end]) + "\n"))
        i = end + 1
    return found


def all_snippets() -> list[Snippet]:
    return [s for path in DOC_FILES for s in snippets(path)]


def resolve(dotted: str):
    """The object a dotted path names: the longest importable module, then attributes."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:split]))
        except ModuleNotFoundError:
            continue
        for name in parts[split:]:
            obj = getattr(obj, name)
        return obj
    raise ModuleNotFoundError(dotted)


def check_names(code: str) -> None:
    """Run the block's imports and resolve every `fusedlayers.x.y` it names (without running it)."""
    tree = ast.parse(code)
    imports = [node for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))]
    exec(compile(ast.Module(body=imports, type_ignores=[]), "<imports>", "exec"), {})
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            dotted = ast.unparse(node)
            if re.fullmatch(r"fusedlayers(\.\w+)+", dotted):
                resolve(dotted)


def documented_parameters(code: str, callable_name: str) -> list[tuple[str, str | None]]:
    """(name, default source or None) for each parameter a signature block lists.

    The block is a call of `callable_name` whose arguments are the parameters, in order, with
    `name=default` for keywords, `name: type` allowed and a bare `*` for the keyword-only marker;
    `#` comments are ignored. It need not be valid Python.
    """
    text = "\n".join(line.split("#", 1)[0] for line in code.splitlines())
    start = text.index(callable_name + "(") + len(callable_name) + 1
    depth, pieces, current = 0, [], ""
    for char in text[start:]:
        if char in "([{":
            depth += 1
        elif char in ")]}":
            if depth == 0:
                break
            depth -= 1
        if char == "," and depth == 0:
            pieces.append(current)
            current = ""
        else:
            current += char
    pieces.append(current)
    params = []
    for piece in (p.strip() for p in pieces):
        if piece in ("", "*"):
            continue
        match = re.fullmatch(r"(\w+)\s*(?::[^=]*)?(?:=\s*(.+))?", piece, re.S)
        if match is None:
            raise ValueError(f"cannot read parameter {piece!r}")
        params.append((match.group(1), match.group(2)))
    return params


def check_signature(snippet: Snippet) -> None:
    fn = resolve(snippet.target)
    short = snippet.target.rsplit(".", 1)[-1]
    documented = documented_parameters(snippet.code, short)
    actual = inspect.signature(fn).parameters
    names = [name for name, _ in documented]
    assert names == list(actual), (
        f"{snippet.id}: documents {snippet.target}({', '.join(names)}), "
        f"but it takes ({', '.join(actual)})"
    )
    for name, default in documented:
        if default is None:
            continue
        try:
            value = ast.literal_eval(default)
        except ValueError:
            continue  # not a literal (an expression the prose explains)
        assert actual[name].default == value, (
            f"{snippet.id}: documents {name}={default}, but {snippet.target}'s default is "
            f"{actual[name].default!r}"
        )


def run_chain(snippet: Snippet, snippets: list[Snippet]) -> dict:
    """Run `snippet` after the blocks it continues, in one namespace; returns the namespace."""
    same_file = [s for s in snippets if s.path == snippet.path and s.line <= snippet.line]
    start = max(i for i, s in enumerate(same_file) if s.kind != "continues")
    namespace: dict = {"__name__": "__snippet__"}
    torch.manual_seed(0)
    for block in same_file[start:]:
        exec(compile(block.code, block.id, "exec"), namespace)
    return namespace
