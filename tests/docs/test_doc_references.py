"""Docs that describe today's tree (issue 56): every path and module docs/ARCHITECTURE.md names exists,
and every reference into docs/BENCHMARKS.md names a section that is there.

A reference into BENCHMARKS.md is written ``BENCHMARKS.md, "Section title"`` (or ``"..."`` without the
comma), ``BENCHMARKS.md (bench_name)``, ``BENCHMARKS.md `bench_name` `` or ``BENCHMARKS.md#anchor``; it
resolves when the title (or name) is part of one heading of docs/BENCHMARKS.md, case aside.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE = ROOT / "docs" / "ARCHITECTURE.md"
BENCHMARKS = ROOT / "docs" / "BENCHMARKS.md"

PATH_TOKEN = re.compile(r"`([A-Za-z0-9_.\-/]+(?:/|\.py|\.md|\.yaml|\.sh|\.json|\.toml))`")
"""A backticked path: a folder (ending in /) or a file of a kind the tree holds."""
MODULE_TOKEN = re.compile(r"`((?:index|training|service|tonearm|bench)(?:\.[A-Za-z_][A-Za-z0-9_]*)+)`")
"""A backticked dotted name under one of the house's packages: a module, or a name inside one."""
BENCH_REF = re.compile(
    r"BENCHMARKS\.md(?:`|\))?(?:,?\s*(?:[\"“]([^\"”\n]{1,100})[\"”]|\(([a-z_]+)\)|`([a-z_]+)`)|#([\w-]+))")


def names_in_architecture(text: str) -> tuple[set[str], set[str]]:
    """Backticked paths (a bare file name is taken relative to a folder the same line names, as in
    "`training/objectives/` | `infonce.py`, `siglip.py`") and backticked dotted module names."""
    paths: set[str] = set()
    for line in text.splitlines():
        tokens = [m.group(1) for m in PATH_TOKEN.finditer(line)]
        folders = [t if t.endswith("/") else t.rpartition("/")[0] + "/" for t in tokens if "/" in t]
        for token in tokens:
            if "/" in token or not folders or (ROOT / token).exists():
                paths.add(token)
            else:  # the first folder of the line that holds it, else the line's first folder (reported missing)
                paths.add(next((f + token for f in folders if (ROOT / f / token).exists()), folders[0] + token))
    modules = {m.group(1) for m in MODULE_TOKEN.finditer(text)}
    return paths, modules


def module_resolves(dotted: str, root: Path = ROOT) -> bool:
    """``a.b.c`` names a module/package file, or a name defined in the longest such prefix."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        base = root.joinpath(*parts[:cut])
        source = base.with_suffix(".py") if base.with_suffix(".py").is_file() else base / "__init__.py"
        if source.is_file():
            rest = parts[cut:]
            if not rest:
                return True
            return re.search(rf"^\s*(?:def|class|async def)\s+{re.escape(rest[0])}\b|^\s*{re.escape(rest[0])}\s*[:=]",
                             source.read_text(encoding="utf-8"), re.M) is not None
    return False


def path_resolves(token: str, root: Path = ROOT) -> bool:
    return (root / token).exists() or (root / "docs" / token).exists()


def test_every_path_and_module_of_the_architecture_doc_exists() -> None:
    paths, modules = names_in_architecture(ARCHITECTURE.read_text(encoding="utf-8"))
    assert len(paths) > 30 and len(modules) > 1, "the checker found too few names: has the doc's style changed?"
    missing = sorted({p for p in paths if not path_resolves(p)} | {m for m in modules if not module_resolves(m)})
    assert not missing, "docs/ARCHITECTURE.md names what the tree does not have:\n" + "\n".join(missing)


def test_the_architecture_checker_fails_on_a_gone_file(tmp_path: Path) -> None:
    (tmp_path / "index").mkdir()
    (tmp_path / "index" / "loader.py").write_text("class LoadedBundle:\n    pass\n")
    paths, modules = names_in_architecture("`index/loader.py` `index/bundle_parts.py` `index.loader.LoadedBundle` "
                                           "`index.loader.Gone` `index/`")
    assert {p for p in paths if not path_resolves(p, tmp_path)} == {"index/bundle_parts.py"}
    assert {m for m in modules if not module_resolves(m, tmp_path)} == {"index.loader.Gone"}


def headings() -> list[str]:
    return [line.lstrip("#").strip().lower() for line in BENCHMARKS.read_text(encoding="utf-8").splitlines()
            if line.startswith("#")]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading).replace(" ", "-")


def broken_references(text: str, heads: list[str]) -> list[str]:
    broken = []
    for match in BENCH_REF.finditer(text):
        title, paren, tick, fragment = match.groups()
        if fragment is not None:
            if fragment.lower() not in {anchor(h) for h in heads}:
                broken.append(f"#{fragment}")
            continue
        wanted = re.sub(r"\s+", " ", (title or paren or tick or "")).strip().lower()
        if wanted and not any(wanted in re.sub(r"\s+", " ", h) for h in heads):
            broken.append(wanted)
    return broken


DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "bench").glob("*.py")])


@pytest.mark.parametrize("path", DOC_FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_reference_into_benchmarks_resolves(path: Path) -> None:
    broken = broken_references(path.read_text(encoding="utf-8"), headings())
    assert not broken, f"{path.relative_to(ROOT)} refers to sections docs/BENCHMARKS.md lacks: {broken}"


def test_the_reference_checker_fails_on_a_lost_section() -> None:
    heads = ["moments_cost — moment search against recording length", "gpu check (`bench/gpu_check.py`)"]
    text = ('see docs/BENCHMARKS.md, "GPU check" and BENCHMARKS.md `moments_head`; BENCHMARKS.md (moments_cost); '
            'BENCHMARKS.md#gpu-check-benchgpu_checkpy; BENCHMARKS.md#gone')
    assert broken_references(text, heads) == ["moments_head", "#gone"]


def test_the_readme_set_up_section_stays_short() -> None:
    """A newcomer reads what to run and what it needs, not the suite's history (issue 56: ≤ 300 words;
    history lives in docs/BENCHMARKS.md, "Test suite time")."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    section = re.search(r"^## Set-up.*?(?=^##)", text, re.S | re.M)
    assert section is not None, "README.md has no '## Set-up' section"
    body = section.group(0)
    assert "make serve" in body and "make test" in body
    words = len(re.findall(r"\S+", body))
    assert words <= 300, f"the set-up section has {words} words (at most 300)"
