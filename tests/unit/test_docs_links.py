"""Every relative link in README.md and docs/*.md resolves: to a file or folder that exists and, for a
`#fragment`, to a heading of the target page, as GitHub makes anchors of headings.

GitHub's anchor of a heading is its text, lowercased, with every character that is not a letter, a
digit, a hyphen, an underscore or a space removed, and each space turned into a hyphen; a second
heading with the same anchor gets "-1" appended, a third "-2". Links to other sites (a scheme such as
https:) are not followed. Links inside code (fenced blocks and `code spans`) are not links.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])

FENCE = re.compile(r"^ {0,3}(```|~~~)")
HEADING = re.compile(r"^ {0,3}(#{1,6})\s+(.*?)\s*#*\s*$")
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.DOTALL)
INLINE_LINK = re.compile(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.MULTILINE)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def prose(text: str) -> str:
    """The text outside fenced code blocks; fenced lines are kept as blank lines."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            lines.append("")
        else:
            lines.append("" if fenced else line)
    return "\n".join(lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading's text (before any -1, -2 for repeats)."""
    text = INLINE_LINK.sub(lambda link: link.group(1), heading)
    text = CODE_SPAN.sub(lambda span: span.group(2), text).lower()
    kept = "".join(char for char in text if char.isalnum() or char in "-_ ")
    return kept.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of every heading on a page."""
    found: set[str] = set()
    seen: dict[str, int] = {}
    for line in prose(text).splitlines():
        heading = HEADING.match(line)
        if heading is None:
            continue
        base = slug(heading.group(2))
        repeat = seen.get(base, 0)
        seen[base] = repeat + 1
        found.add(base if repeat == 0 else f"{base}-{repeat}")
    return found


def links(text: str) -> list[str]:
    """Every link target on a page, in order, code excluded."""
    outside = CODE_SPAN.sub(" ", prose(text))
    return [m.group(2) for m in INLINE_LINK.finditer(outside)] + REFERENCE.findall(outside)


def broken_links(page: Path) -> list[str]:
    """The links on `page` that name a missing file or folder, or a heading its target lacks."""
    broken = []
    for target in links(page.read_text()):
        if SCHEME.match(target):
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target}: no such file")
        elif fragment and not resolved.is_file():
            broken.append(f"{target}: a folder has no headings")
        elif fragment and fragment not in anchors(resolved.read_text()):
            broken.append(f"{target}: no heading with that anchor in {resolved.name}")
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken_links(page) == [], f"broken links in {page.relative_to(ROOT)}"


def test_the_pages_are_found_and_link_to_each_other() -> None:
    assert ROOT / "README.md" in PAGES and len(PAGES) > 2
    front = links((ROOT / "README.md").read_text())
    for page in PAGES[1:]:
        assert any(link.split("#")[0] == f"docs/{page.name}" for link in front), f"README omits {page.name}"


@pytest.mark.parametrize(
    ("heading", "anchor"),
    [
        ("Quickstart", "quickstart"),
        (
            "Under pressure: admission, backpressure, fallback",
            "under-pressure-admission-backpressure-fallback",
        ),
        ("The `timing` of each response", "the-timing-of-each-response"),
        ("Kubernetes (`deploy/k8s/`)", "kubernetes-deployk8s"),
        ("Where the other 40% goes", "where-the-other-40-goes"),
        (
            "The model implementation (`services/worker/model/`)",
            "the-model-implementation-servicesworkermodel",
        ),
        ("a [linked](x.md) max_num_seqs  twice", "a-linked-max_num_seqs--twice"),
    ],
)
def test_anchors_follow_github(heading: str, anchor: str) -> None:
    assert slug(heading) == anchor


def test_a_broken_file_anchor_or_repeat_is_caught_and_code_is_not_a_link(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Title\n\n## Same\n\n## Same\n\n```\n# not a heading\n```\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Here\n\n"
        "[ok](other.md#same-1) [ok](other.md#title) [ok](#here) [ok](https://example.com/x.md)\n"
        "[no file](missing.md) [no anchor](other.md#not-a-heading) [too many](other.md#same-2)\n"
        "[split\nacross lines](#nowhere) `[in code](missing.md)`\n\n"
        "```\n[in a block](missing.md)\n```\n\n"
        "[ref]: gone/ref.md\n"
    )
    assert broken_links(page) == [
        "missing.md: no such file",
        "other.md#not-a-heading: no heading with that anchor in other.md",
        "other.md#same-2: no heading with that anchor in other.md",
        "#nowhere: no heading with that anchor in page.md",
        "gone/ref.md: no such file",
    ]
