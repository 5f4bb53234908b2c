"""Every ```python block of README.md and docs/*.md runs as written.

Docs drift from the code silently; running their examples catches it. Each block runs alone, in
a fresh namespace and a temporary working directory, as a reader who copies that one block
would run it: blocks must be self-contained. Snippet lines (``--8<-- "path:start:end"``, as
pymdownx.snippets renders them in the docs site) are replaced by the lines they include.

A block that cannot run as written (a fragment, or one that needs a GPU or a download) is marked
by an HTML comment on the line before its opening fence, ``<!-- no-run: why -->``; it is
reported as skipped with that reason, never silently passed over. Blocks must stay fast on the
shipped tiny pair: shrink a slow example in the doc rather than marking it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NO_RUN = re.compile(r"<!--\s*no-run:?\s*(.*?)\s*-->")
SNIPPET = re.compile(r'^\s*--8<--\s+"([^":]+)(?::(\d*))?(?::(\d*))?"\s*$')


@dataclass(frozen=True)
class Block:
    """One ```python block: where it is, its code, and why it must not run (None: it runs)."""

    where: str
    code: str
    no_run: str | None


def python_blocks(path: Path) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    blocks: list[Block] = []
    index = 0
    while index < len(lines):
        if lines[index].strip() != "```python":
            index += 1
            continue
        start = index
        end = next(i for i in range(start + 1, len(lines)) if lines[i].strip() == "```")
        previous = next((lines[i] for i in range(start - 1, -1, -1) if lines[i].strip()), "")
        marker = NO_RUN.search(previous)
        reason = (marker.group(1) or "marked no-run") if marker else None
        code = "\n".join(expand_snippet(line) for line in lines[start + 1 : end])
        blocks.append(Block(f"{path.relative_to(ROOT)}:{start + 1}", code, reason))
        index = end + 1
    return blocks


def expand_snippet(line: str) -> str:
    """A pymdownx.snippets line -> the lines it includes (1-based, inclusive); else the line."""
    match = SNIPPET.match(line)
    if match is None:
        return line
    name, first, last = match.groups()
    included = (ROOT / name).read_text(encoding="utf-8").splitlines()
    start = int(first) - 1 if first else 0
    stop = int(last) if last else len(included)
    return "\n".join(included[start:stop])


BLOCKS = [block for path in DOCS for block in python_blocks(path)]


def test_the_docs_have_python_blocks() -> None:
    """The collection above works: the README's own examples are among the blocks."""
    assert sum(block.where.startswith("README.md") for block in BLOCKS) >= 2
    assert any("import" in block.code for block in BLOCKS)


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.no_run is not None:
        pytest.skip(f"marked <!-- no-run --> in the doc: {block.no_run}")
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    exec(compile(block.code, block.where, "exec"), {"__name__": "__doc_block__"})
