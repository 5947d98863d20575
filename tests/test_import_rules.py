"""The package layering of docs/ARCHITECTURE.md, checked on the source itself.

``index`` is the torch-free library under both ``training`` and ``service``;
``service`` serves bundles without torch. Every import statement counts,
including those inside functions (a lazy ``import torch`` still breaks a
torch-free image once that path runs).

Inside ``index`` the modules form a graph without cycles, and the layers named in
:data:`INDEX_LAYERS` import only downward: errors → bundle format → backends → loader →
verification (a lazy import counts here too: it is still a cycle once that path runs).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN = {
    # `tonearm` is the CLI package above index: index raises its own errors (index.errors).
    "index": {"torch", "torchaudio", "training", "service", "transformers", "tonearm"},
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


INDEX_LAYERS = {
    "errors": 0,
    "bundle": 1,
    "faiss_index": 2,
    "vector_index": 2,
    "milvus_index": 2,
    "loader": 3,
    "verify": 4,
}
"""Rank of each layered module of ``index``: a module imports only modules of a lower (or, among
the backends, the same) rank."""


def package_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> sibling modules it imports (``from pkg import mod``, ``from pkg.mod import x``, lazy ones too)."""
    package = package_dir.name
    graph: dict[str, set[str]] = {}
    for path in sorted(package_dir.glob("*.py")):
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name.split(".") for alias in node.names]
                deps |= {parts[1] for parts in names if parts[0] == package and len(parts) > 1}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                parts = node.module.split(".")
                if parts[0] == package:
                    deps |= {parts[1]} if len(parts) > 1 else {alias.name for alias in node.names}
        graph[path.stem] = deps - {path.stem}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*path[path.index(dep):], dep] if dep in path else [node, dep]
            if dep not in state and (cycle := visit(dep, [*path, dep])):
                return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start, [start])):
            return cycle
    return None


def upward_imports(graph: dict[str, set[str]], layers: dict[str, int]) -> list[str]:
    return [
        f"{module} (layer {layers[module]}) imports {dep} (layer {layers[dep]})"
        for module, deps in sorted(graph.items())
        if module in layers
        for dep in sorted(deps)
        if dep in layers and layers[dep] > layers[module]
    ]


def test_index_modules_import_without_cycles_and_only_downward() -> None:
    graph = package_graph(ROOT / "index")
    assert set(INDEX_LAYERS) <= set(graph), f"layered modules missing: {set(INDEX_LAYERS) - set(graph)}"
    assert find_cycle(graph) is None, f"import cycle in index: {' -> '.join(find_cycle(graph) or [])}"
    assert not upward_imports(graph, INDEX_LAYERS), "\n".join(upward_imports(graph, INDEX_LAYERS))


def test_checker_finds_cycles_and_upward_imports(tmp_path: Path) -> None:
    """The checker itself: the bundle -> loader -> milvus_index -> bundle circle index had (lazy imports)."""
    package = tmp_path / "index"
    package.mkdir()
    (package / "bundle.py").write_text("def verify():\n    from index.loader import LoadedBundle\n")
    (package / "loader.py").write_text("def open_():\n    from index.milvus_index import open_bundle_indices\n")
    (package / "milvus_index.py").write_text("from index import bundle as fmt\n")
    graph = package_graph(package)
    assert find_cycle(graph) == ["bundle", "loader", "milvus_index", "bundle"]
    assert upward_imports(graph, INDEX_LAYERS) == ["bundle (layer 1) imports loader (layer 3)"]
    (package / "bundle.py").write_text("import numpy\n")
    assert find_cycle(package_graph(package)) is None


def test_code_imports_errors_from_index_errors_not_the_cli_reexport() -> None:
    """training/, service/ and bench/ sit beside or above index/: they import errors from
    index.errors (tonearm.errors only re-exports them for code written against it)."""
    root = Path(__file__).resolve().parents[1]
    offenders = [
        str(path.relative_to(root))
        for folder in ("training", "service", "bench", "index")
        for path in (root / folder).rglob("*.py")
        if "from tonearm.errors import" in path.read_text() or "import tonearm.errors" in path.read_text()
    ]
    assert offenders == []


def _imported_modules(path: Path) -> set[str]:
    """Every module an import statement names in ``path`` (lazy ones too), full dotted names."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
    return found


def test_trained_and_pretrained_exports_do_not_import_each_other() -> None:
    """Issue 41: one pipeline, its shared parts in training/bundle/parts.py, the CLI in
    training/bundle/cli.py; neither training/bundle/export.py nor training/bundle/pretrained.py imports the other
    (issue 49: the files that make a bundle live together in training/bundle/)."""
    export, pretrained = (_imported_modules(ROOT / "training" / "bundle" / f"{name}.py") for name in ("export", "pretrained"))
    assert not {m for m in export if m == "training.bundle.pretrained" or m.startswith("training.bundle.pretrained.")}
    assert not {m for m in pretrained if m == "training.bundle.export" or m.startswith("training.bundle.export.")}
    assert "training.bundle.parts" in export and "training.bundle.parts" in pretrained
