"""Sphinx roles in specselect's docstrings, rendered as links or code in the API reference.

The docstrings are read in editors and with ``help()`` as much as on the site, and they use
Sphinx's roles (``:meth:`select```, ``:class:`~specselect.cost.CostModel```) and RST
literal-block markers (``per row::``). mkdocstrings renders Markdown, which would show both raw.
mkdocs.yml names this file twice:

- as a griffe extension (mkdocstrings-python's ``extensions`` option): once the package is
  loaded, :class:`RstRoles` rewrites every docstring with :func:`rst_to_markdown`. A role whose
  target is a specselect object (resolved like Python names, in the scope of the docstring's
  object) becomes an *optional* autorefs reference (an ``<autoref>`` tag, which
  mkdocs-autorefs >= 1.1 reads; mkdocstrings >= 0.26 requires 1.2): autorefs links it if that
  object is rendered on the site and else shows its code alone, without a warning. Any other
  target becomes inline code. So the build links exactly what can be linked and never fails
  on a reference to a private helper.
- as an mkdocs hook (``hooks:``): :func:`on_page_content` warns about any role or ``::`` left
  in a page, which ``mkdocs build --strict`` (CI) turns into an error.

:func:`rst_to_markdown` is pure (the name resolution is passed in) so that it is tested alone.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable
from html import escape
from typing import Any

from griffe import Alias, Class, Extension, Object

ROLE = re.compile(
    r":(?:py:)?(?:mod|func|data|const|class|meth|attr|exc|obj|type):`(?P<body>[^`]+)`"
)
"""A Sphinx Python-domain role; its body is ``target``, ``~target`` or ``title <target>``."""
TITLED = re.compile(r"(?P<title>.+?)\s*<(?P<target>[^<>]+)>", re.DOTALL)
LITERAL_MARKER = re.compile(r"(?<=[^\s:])::[ \t]*$", re.MULTILINE)
"""RST's ``text::`` before a literal block, which Sphinx shows as ``text:``."""
LONE_LITERAL_MARKER = re.compile(r"(?:^|[ \t]+)::[ \t]*$", re.MULTILINE)
"""RST's ``text ::`` or a line ``::``, which Sphinx does not show."""
CODE = re.compile(
    r"(^[ \t]*```.*?^[ \t]*```[ \t]*$|^[ \t]*(?:>>>|\.\.\.)(?: [^\n]*)?$)", re.MULTILINE | re.DOTALL
)
"""A fenced code block or a doctest line (``>>> ``, ``... ``): code, not RST to rewrite."""
LEFT_IN_HTML = re.compile(r":(?:[a-z]+:)?[a-z]+:(?:<code>|`)|[^\s:]::\s*</p>")
"""A role or a ``::`` marker as it shows in a page's HTML when nothing converted it."""

log = logging.getLogger("mkdocs.hooks.docs_roles")  # under "mkdocs": --strict counts it


def rst_to_markdown(text: str, resolve: Callable[[str], str | None]) -> str:
    """``text`` with each role as a link or inline code, and ``::`` markers as ``:``.

    ``resolve`` maps a target as written (``~``, ``!`` and a trailing ``()`` removed) to the
    identifier to link to, or None for code only. The text shown is what Sphinx shows: the
    title, else the last component with ``~``, else the target as written.
    """

    def replace(match: re.Match[str]) -> str:
        titled = TITLED.fullmatch(match["body"])
        title, target = (titled["title"], titled["target"]) if titled else (None, match["body"])
        title = title and " ".join(title.split())  # a role may wrap across lines
        target = "".join(target.split())
        bare = target.lstrip("~!.")
        shown = title or (bare.rsplit(".", 1)[-1] if target.startswith("~") else bare)
        identifier = None if target.startswith("!") else resolve(bare.removesuffix("()"))
        # A Markdown code span, not <code>: Markdown would read the _ of <code>_update</code>
        # as emphasis. A role's body has no backtick.
        if identifier is None:
            return f"`{shown}`"
        return f'<autoref identifier="{escape(identifier)}" optional>`{shown}`</autoref>'

    def prose(part: str) -> str:
        part = ROLE.sub(replace, part)
        return LONE_LITERAL_MARKER.sub("", LITERAL_MARKER.sub(":", part))

    # Code is shown as written: fenced blocks and doctest lines are left alone.
    pieces = CODE.split(text)
    return "".join(p if i % 2 else prose(p) for i, p in enumerate(pieces))


class RstRoles(Extension):
    """Rewrites the docstrings of a loaded package with :func:`rst_to_markdown`."""

    def on_package(self, *, pkg: Object, **kwargs: Any) -> None:
        """Runs once the whole package is loaded, so that every name can be resolved."""
        for obj in walk(pkg):
            if obj.docstring is not None:
                obj.docstring.value = rst_to_markdown(obj.docstring.value, resolver(obj, pkg))

    if not hasattr(Extension, "on_package"):  # griffe before 1.14 names the event so
        on_package_loaded = on_package


def walk(obj: Object) -> list[Object]:
    """``obj`` and every object defined under it (imported names, aliases, are skipped: their
    docstrings are rewritten where they are defined)."""
    found = [obj]
    for member in obj.members.values():
        if not isinstance(member, Alias):
            found.extend(walk(member))
    return found


def resolver(scope: Object, pkg: Object) -> Callable[[str], str | None]:
    """Resolves a target written in ``scope``'s docstring to the canonical path of the ``pkg``
    object it names (see :func:`named`), or None."""

    def resolve(target: str) -> str | None:
        found = named(scope, target, pkg)
        return None if found is None else found.path

    return resolve


def named(scope: Object, target: str, pkg: Object, depth: int = 0) -> Object | None:
    """The object of ``pkg`` that the dotted ``target`` names: an absolute path, or a name looked
    up as Sphinx does, in ``scope`` (with a class's inherited members), then its parents."""
    first, *rest = target.split(".")
    if first == pkg.name:
        found: Object | None = pkg
    else:
        scopes = (scope, *parents(scope))
        found = next((m for s in scopes if (m := member(s, first, pkg, depth)) is not None), None)
    for name in rest:
        found = None if found is None else member(found, name, pkg, depth)
    return found


def member(obj: Object, name: str, pkg: Object, depth: int) -> Object | None:
    """``obj``'s member ``name`` (imported: the object it imports if in ``pkg``); for a class,
    also an inherited one."""
    if depth > 10:  # an import cycle
        return None
    found = obj.members.get(name)
    if isinstance(found, Alias):
        path = found.target_path
        return named(pkg, path, pkg, depth + 1) if path.startswith(f"{pkg.name}.") else None
    if found is None and isinstance(obj, Class) and obj.parent is not None:
        for base in obj.bases:
            base_class = named(obj.parent, str(base), pkg, depth + 1)
            inherited = None if base_class is None else member(base_class, name, pkg, depth + 1)
            if inherited is not None:
                return inherited
    return found


def parents(obj: Object) -> list[Object]:
    """``obj``'s parent, its parent, and so on up to the package."""
    return [] if obj.parent is None else [obj.parent, *parents(obj.parent)]


def on_page_content(html: str, page: Any, **kwargs: Any) -> str:
    """mkdocs hook: a role or ``::`` that the rewrite missed fails the strict build."""
    for left in LEFT_IN_HTML.finditer(html):
        context = html[max(0, left.start() - 60) : left.end() + 60].replace("\n", " ")
        log.warning("%s: raw RST in the rendered docs: ...%s...", page.file.src_path, context)
    return html
