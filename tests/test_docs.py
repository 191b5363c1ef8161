"""The pages under docs/: the generated configuration reference is current and lists every
``CacheConfig`` field once, and every relative link resolves to a file."""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from pathlib import Path

import pytest

from kvtier.config import CacheConfig

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def _generator():
    spec = importlib.util.spec_from_file_location(
        "gen_config_docs", ROOT / "scripts" / "gen_config_docs.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_reference_is_current():
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    assert page == _generator().render(), (
        "docs/configuration.md is stale: run python scripts/gen_config_docs.py > "
        "docs/configuration.md"
    )


def test_configuration_reference_lists_every_field_once():
    page = (DOCS / "configuration.md").read_text(encoding="utf-8")
    headings = re.findall(r"^### `(\w+)`$", page, flags=re.MULTILINE)
    fields = [f.name for f in dataclasses.fields(CacheConfig)]
    assert sorted(headings) == sorted(fields)
    assert len(headings) == len(set(headings))


def test_generator_refuses_a_field_in_no_group_or_in_two():
    gen = _generator()
    names = [f.name for f in dataclasses.fields(CacheConfig)]
    gen.check_groups(names)
    with pytest.raises(ValueError, match="in no group: new_field"):
        gen.check_groups([*names, "new_field"])
    title, intro, fields = gen.GROUPS[0]
    gen.GROUPS = ((title, intro, (*fields, fields[0])), *gen.GROUPS[1:])
    with pytest.raises(ValueError, match=f"in several groups: {fields[0]}"):
        gen.check_groups(names)


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^```.*?^```", flags=re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")


def _relative_links(page: Path) -> list[str]:
    """The relative targets of ``page``'s Markdown links (code left out), anchors included."""
    text = _CODE.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return [t for t in _LINK.findall(text) if not re.match(r"^[a-z][a-z0-9+.-]*:", t)]


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives ``page``'s headings: lower case, punctuation dropped, spaces
    as hyphens, ``-1``, ``-2``... on repeats."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _broken(page: Path) -> list[str]:
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path) if path else page
        missing = not dest.exists()
        if missing or (anchor and dest.suffix == ".md" and anchor not in _anchors(dest)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_relative_links_resolve(page: Path):
    broken = _broken(page)
    assert not broken, f"{page.relative_to(ROOT)} links to missing files or headings: {broken}"


def test_link_check_finds_what_is_broken(tmp_path: Path):
    (tmp_path / "there.md").write_text("# A `code` heading: here\n\n## Twice\n\n## Twice\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](there.md) [ok](there.md#a-code-heading-here) [ok](there.md#twice-1) "
        "[ok](#local) [url](https://example.com/x.md) `[code](gone.md)`\n"
        "[gone](gone.md) [bad anchor](there.md#nowhere) [bad local](#nowhere)\n\n# Local\n"
    )
    assert _broken(page) == ["gone.md", "there.md#nowhere", "#nowhere"]
