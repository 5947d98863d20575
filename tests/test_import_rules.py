"""The package layering of docs/ARCHITECTURE.md, checked on the source itself.

``index`` is the torch-free library under both ``training`` and ``service``;
``service`` serves bundles without torch. Every import statement counts,
including those inside functions (a lazy ``import torch`` still breaks a
torch-free image once that path runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    "index": {"torch", "torchaudio", "training", "service", "transformers"},
    "service": {"torch", "torchaudio", "training", "transformers"},
}


def imported_top_levels(path: Path) -> set[tuple[str, int]]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[tuple[str, int]] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {(alias.name.split(".")[0], node.lineno) for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add((node.module.split(".")[0], node.lineno))
    return found


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_nothing_forbidden(package: str) -> None:
    files = sorted((ROOT / package).rglob("*.py"))
    assert files, f"no sources under {package}/"
    violations = [
        f"{path.relative_to(ROOT)}:{line} imports {name}"
        for path in files
        for name, line in sorted(imported_top_levels(path))
        if name in FORBIDDEN[package]
    ]
    assert not violations, "\n".join(violations)


def test_checker_sees_lazy_imports(tmp_path: Path) -> None:
    """The checker itself: an import inside a function is found."""
    source = tmp_path / "lazy.py"
    source.write_text("def f():\n    import torch.nn\n    from training.loop import x\n")
    assert {name for name, _ in imported_top_levels(source)} == {"torch", "training"}
