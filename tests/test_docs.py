"""Every ```python block of README.md and docs/*.md runs as written.

Docs drift from the code silently; running their examples catches it. Each block runs alone, in
a fresh namespace and a temporary working directory, as a reader who copies that one block
would run it: blocks must be self-contained. Snippet lines (``--8<-- "path:start:end"``, as
pymdownx.snippets renders them in the docs site) are replaced by the lines they include.

A block that cannot run as written (a fragment, or one that needs a GPU or a download) is marked
by an HTML comment on the line before its opening fence, ``<!-- no-run: why -->``; it is
reported as skipped with that reason, never silently passed over. Blocks must stay fast on the
shipped tiny pair: shrink a slow example in the doc rather than marking it.

The API reference renders the docstrings, whose Sphinx roles (``:meth:`select```)
``scripts/docs_roles.py`` turns into links or code for mkdocstrings; a wrong conversion does not
fail the docs build (it shows or links the wrong name), so its conversion is tested here.
"""

from __future__ import annotations

import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

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
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        blocks.append(Block(f"{where}:{start + 1}", code, reason))
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


def test_no_run_marker_and_snippets(tmp_path: Path) -> None:
    doc = tmp_path / "doc.md"
    doc.write_text(
        "<!-- no-run: needs a GPU -->\n```python\nimport cuda_only\n```\n\n"
        '```python\n--8<-- "examples/custom_loop.py:3:5"\n```\n',
        encoding="utf-8",
    )
    marked, included = python_blocks(doc)
    assert marked.no_run == "needs a GPU"
    assert included.no_run is None
    assert included.code == "import torch\n\nfrom specselect import TetrisSelector"


@pytest.mark.parametrize("block", BLOCKS, ids=[block.where for block in BLOCKS])
def test_python_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if block.no_run is not None:
        pytest.skip(f"marked <!-- no-run --> in the doc: {block.no_run}")
    monkeypatch.chdir(tmp_path)  # blocks that write files write them here
    # A block may register a selector of its own: conftest removes it after the test.
    exec(compile(block.code, block.where, "exec"), {"__name__": "__doc_block__"})


def test_readme_loop_is_in_the_example() -> None:
    """The README says ``examples/custom_loop.py`` runs its loop (with a seed and a print): the
    example holds every line of the README's block, in order."""
    (block,) = [b for b in BLOCKS if b.where.startswith("README.md") and "observe(" in b.code]
    example = iter((ROOT / "examples" / "custom_loop.py").read_text(encoding="utf-8").splitlines())
    missing = [line for line in block.code.splitlines() if line.strip() and line not in example]
    assert not missing, missing


def test_readme_table_excerpt_has_the_real_header() -> None:
    """The README's excerpt of ``specselect compare``'s table starts with the lines (the cost
    model, the header and the rule) that the table of a default run has."""
    from specselect.cli import default_selectors
    from specselect.cost import default_cost_model
    from specselect.metrics import Totals
    from specselect.replay import ResultRow, SelectorConfig
    from specselect.report import format_table

    names = ["fixed", *default_selectors(), "oracle"]
    totals = Totals(steps=4, active=8, verified=16, accepted=8, emitted=16, seconds=1.0)
    rows = [ResultRow(SelectorConfig(name, 3, 2, None, {}), totals) for name in names]
    table = format_table(rows, cost_model=default_cost_model().describe())
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    excerpt = readme.split("```text\n", 1)[1].splitlines()
    assert excerpt[:3] == table.splitlines()[:3]


@pytest.fixture(scope="module")
def docs_roles() -> ModuleType:
    """``scripts/docs_roles.py`` (it imports griffe, which the dev extra's mkdocstrings brings)."""
    spec = importlib.util.spec_from_file_location("docs_roles", ROOT / "scripts" / "docs_roles.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_roles_become_links_or_code(docs_roles: ModuleType) -> None:
    """A resolved target links (optionally: autorefs shows the code alone if it is not rendered);
    an unknown one is code. Shown as Sphinx shows it: ``~`` keeps the last name, a title wins."""
    paths = {"CostModel.fit": "specselect.cost.CostModel.fit", "select": "specselect.S.select"}
    paths["specselect.cost.CostModel"] = "specselect.cost.CostModel"

    def convert(text: str) -> str:
        return docs_roles.rst_to_markdown(text, paths.get)

    fit = '<autoref identifier="specselect.cost.CostModel.fit" optional>`{}`</autoref>'
    assert convert("See :meth:`CostModel.fit`.") == f"See {fit.format('CostModel.fit')}."
    assert convert(":meth:`fitting it <CostModel.fit>`") == fit.format("fitting it")
    assert convert(":class:`~specselect.cost.\n    CostModel`") == (
        '<autoref identifier="specselect.cost.CostModel" optional>`CostModel`</autoref>'
    )
    assert convert(":py:meth:`select()`") == (
        '<autoref identifier="specselect.S.select" optional>`select()`</autoref>'
    )
    assert convert(":func:`torch.topk`, :func:`~torch.topk`") == "`torch.topk`, `topk`"
    assert convert(":meth:`!select`, ``select``") == "`select`, ``select``"


def test_literal_block_markers(docs_roles: ModuleType) -> None:
    """RST's ``text::`` shows as ``text:``; ``text ::`` and a lone ``::`` line show nothing."""

    def convert(text: str) -> str:
        return docs_roles.rst_to_markdown(text, lambda _: None)

    assert convert("per row::\n\n    a + b\n") == "per row:\n\n    a + b\n"
    assert convert("Example ::\n\n    a\n::\n\n    b") == "Example\n\n    a\n\n\n    b"
    assert convert("x[::2] and a::b stay") == "x[::2] and a::b stay"
    code = "Code stays::\n\n```cpp\nstd::\n:func:`f`\n```\n>>> a = b::\n... c::\nafter::"
    assert convert(code) == code.replace("stays::", "stays:").replace("after::", "after:")


def test_targets_resolve_like_names(docs_roles: ModuleType) -> None:
    """A role's target resolves in its docstring's scope (members, inherited members, imports,
    then the enclosing scopes), to the canonical path; a name outside the package does not."""
    from griffe import temporary_visited_package

    files = {
        "__init__.py": "from pkg.base import Base\n",
        "base.py": "import torch\nclass Base:\n    def step(self): ...\n",
        "child.py": "from pkg import Base\nclass Child(Base):\n    def run(self): ...\n",
    }
    with temporary_visited_package("pkg", files) as pkg:
        resolve = docs_roles.resolver(pkg["child.Child.run"], pkg)
        assert resolve("step") == "pkg.base.Base.step"  # inherited, via two imports
        assert resolve("Child.run") == "pkg.child.Child.run"
        assert resolve("pkg.Base") == "pkg.base.Base"
        assert resolve("missing") is None
        assert docs_roles.resolver(pkg["base.Base"], pkg)("torch.topk") is None


def test_every_command_line_option_is_in_the_guide() -> None:
    """docs/compare.md documents each option of ``compare`` and ``profile`` (an option added to
    the parser and not to the guide fails here)."""
    import argparse

    from specselect.cli import build_parser

    guide = (ROOT / "docs" / "compare.md").read_text(encoding="utf-8")
    (commands,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    assert set(commands.choices) == {"compare", "profile"}
    for name, parser in commands.choices.items():
        options = [o for a in parser._actions for o in a.option_strings if o.startswith("--")]
        missing = [o for o in options if o != "--help" and f"`{o}" not in guide]
        assert not missing, f"specselect {name}: {missing} not in docs/compare.md"


def test_the_guide_shows_speculative_generate_s_signature() -> None:
    """docs/guide-generation.md's signature of ``speculative_generate`` names its parameters
    in order (a parameter added to the function and not to the guide fails here)."""
    import inspect

    from specselect.hf import speculative_generate

    guide = (ROOT / "docs" / "guide-generation.md").read_text(encoding="utf-8")
    shown = re.search(r"`speculative_generate\((.*?)\)`", guide, re.DOTALL)
    assert shown is not None, "no `speculative_generate(...)` signature in the guide"
    names = [re.split(r"[=\s]", part.strip())[0] for part in shown.group(1).split(",")]
    real = list(inspect.signature(speculative_generate).parameters)
    assert [n for n in names if n != "*"] == real
