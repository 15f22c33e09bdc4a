"""The repository's documentation points only at files the repository has.

- every relative link (``[text](path)``, ``![alt](path)``, ``[ref]: path``) in README.md,
  SECURITY.md and docs/*.md names an existing file or folder inside the repository: a clone has
  no ``../shared/`` (or any other place outside it), and a renamed file must not leave dead links;
- every module path in the module map of docs/design.md exists, and the map covers every package
  of ``megatron_fp4`` (a new package gets a row, a removed module loses its row).

Links inside fenced code blocks and inline code are not links and are not checked; ``http(s)``,
``mailto`` and in-page ``#anchor`` links are left alone.
"""
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOCS = sorted([ROOT / "README.md", ROOT / "SECURITY.md", *(ROOT / "docs").glob("*.md")])
DESIGN = ROOT / "docs" / "design.md"

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_CODE = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$")
_EXTERNAL = re.compile(r"^([a-z][a-z0-9+.-]*:|//|#)", re.IGNORECASE)


def relative_links(text: str):
    """(line number, target) of every relative link outside code."""
    in_fence = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
            continue
        if in_fence:
            continue
        ref = _REF_LINK.match(line)
        targets = [ref.group(1)] if ref else []
        # link text may be inline code ([`x`](x)): drop code spans only outside the "](...)" part
        targets += _INLINE_LINK.findall(_INLINE_CODE.sub(lambda m: "x" * len(m.group(0)), line))
        for target in targets:
            if not _EXTERNAL.match(target):
                yield n, target


def broken_links(doc: pathlib.Path) -> list[str]:
    bad = []
    for n, target in relative_links(doc.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0].split("?", 1)[0]
        resolved = (doc.parent / path).resolve()
        where = f"{doc.relative_to(ROOT)}:{n}: ({target})"
        if not resolved.is_relative_to(ROOT):
            bad.append(f"{where} points outside the repository; link a file inside it (docs/design.md?)")
        elif not resolved.exists():
            bad.append(f"{where} names a file that does not exist")
    return bad


def test_link_scanner_sees_links_and_skips_code():
    text = ("see [`../shared/DESIGN.md`](../shared/DESIGN.md) and [x](docs/a.md#sec)\n"
            "![plot](p.png) [web](https://x.org) [here](#top)\n"
            "[ref]: tools/x.py\n"
            "`[not](a_link.md)`\n"
            "```\n[also not](b.md)\n```\n")
    assert list(relative_links(text)) == [(1, "../shared/DESIGN.md"), (1, "docs/a.md#sec"), (2, "p.png"),
                                          (3, "tools/x.py")]


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_names_a_file_in_the_repository(doc):
    bad = broken_links(doc)
    assert not bad, "broken links:\n" + "\n".join(bad)


def module_map_paths() -> list[str]:
    """Backquoted repository paths in the first column of the table under '## Module map'."""
    text = DESIGN.read_text(encoding="utf-8")
    section = re.search(r"^## Module map\s*$(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert section, "docs/design.md has no '## Module map' section"
    paths = []
    for line in section.group(1).splitlines():
        cells = line.strip().strip("|").split("|")
        if line.lstrip().startswith("|") and len(cells) >= 2:
            paths += re.findall(r"`([^`]+)`", cells[0])
    return paths


def test_design_module_map_names_existing_modules():
    paths = module_map_paths()
    missing = [p for p in paths if not (ROOT / p).exists() or "*" in p]
    assert not missing, "docs/design.md module map names paths that do not exist: " + ", ".join(missing)


def test_design_module_map_covers_every_package():
    paths = module_map_paths()
    packages = sorted(str(d.relative_to(ROOT)) for d in (ROOT / "megatron_fp4").rglob("*")
                      if d.is_dir() and (d / "__init__.py").exists())
    uncovered = [pkg for pkg in packages
                 if not any(p == pkg or p.startswith(pkg + "/") for p in paths)]
    assert not uncovered, "docs/design.md module map has no row for: " + ", ".join(uncovered)
