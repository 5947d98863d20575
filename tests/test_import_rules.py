"""The package layering of docs/ARCHITECTURE.md, checked on the source itself.

``index`` is the torch-free library under both ``training`` and ``service``;
``service`` serves bundles without torch. Every import statement counts,
including those inside functions (a lazy ``import torch`` still breaks a
torch-free image once that path runs).

No module of the house (index, training, service, tonearm, bench) takes part in an import cycle, lazy
imports included (a lazy import is still a cycle once that path runs), and the parts of ``index``
ranked in :data:`INDEX_RANKS` import only downward (index/__init__.py). Function-level imports of our
own modules are counted per file against a committed baseline (tests/function_level_imports.txt): one
more than a file's baseline fails until it is moved to the top or justified (see
:func:`test_no_new_function_level_import_of_a_project_module` for how to regenerate the baseline).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import Counter
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


INDEX_RANKS = {
    "errors": 0,
    "languages": 1, "cpus": 1, "ids": 1,
    "audio": 2, "metrics": 2,
    "bundle": 3,
    "moments": 4,
    "engines": 5,
    "items": 6, "runtime": 6,
    "catalogue": 7,
}
"""Rank of each part of ``index`` (a module of its own folder or a subpackage; index/__init__.py's
table): a part imports only parts of a lower rank, never a sibling of its own rank."""

PROJECT = ("index", "training", "service", "tonearm", "bench")
"""Top-level packages of the house: the graph below spans all of them."""

BASELINE = ROOT / "tests" / "function_level_imports.txt"
"""``path count`` per file: the function-level imports of project modules each file may have (sorted by path)."""


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_modules(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    return {
        _module_name(path, root): path
        for package in packages if (root / package).is_dir()
        for path in sorted((root / package).rglob("*.py"))
        if ".venv" not in path.parts
    }


def _imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """(project module imported, line, inside a function?) for every import statement of ``path``.

    ``from a.b import c`` names module ``a.b.c`` when that is a module, else ``a.b``; an import of a
    package's ``__init__`` counts as an import of that package, not of its children."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    nested: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            nested |= {id(inner) for inner in ast.walk(node) if inner is not node}
    found: list[tuple[str, int, bool]] = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            targets = [
                f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in modules else node.module
                for alias in node.names
            ]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target:
                found.append((target, node.lineno, id(node) in nested))
    return found


def import_graph(root: Path, packages: tuple[str, ...] = PROJECT) -> dict[str, set[str]]:
    """Project module -> project modules it imports (lazy imports too: a cycle is a cycle once that path runs)."""
    modules = _project_modules(root, packages)
    return {
        name: {target for target, _, _ in _imports_of(path, modules) if target != name}
        for name, path in modules.items()
    }


def function_level_imports(root: Path, packages: tuple[str, ...] = PROJECT) -> list[str]:
    """``file:line -> module`` for each import of a project module made inside a function (once per line
    and module: ``from a import b, c`` is one import of ``a``)."""
    modules = _project_modules(root, packages)
    found = [
        f"{path.relative_to(root)}:{line} -> {target}"
        for path in modules.values()
        for target, line, lazy in _imports_of(path, modules)
        if lazy
    ]
    return list(dict.fromkeys(found))


def function_level_import_counts(root: Path, packages: tuple[str, ...] = PROJECT) -> dict[str, int]:
    """File (relative to ``root``) -> its function-level imports of project modules, for files with any."""
    return dict(sorted(Counter(entry.rsplit(":", 1)[0] for entry in function_level_imports(root, packages)).items()))


def read_baseline(path: Path = BASELINE) -> dict[str, int]:
    baseline: dict[str, int] = {}
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip() and not line.startswith("#"):
            name, _, count = line.rpartition(" ")
            if not name or not count.isdigit():
                raise ValueError(f"{path}:{number}: expected 'path count', got {line!r}")
            baseline[name] = int(count)
    return baseline


def write_baseline(path: Path = BASELINE, root: Path = ROOT) -> dict[str, int]:
    """Rewrite the baseline from the tree as it is (``python tests/test_import_rules.py --write-baseline``)."""
    counts = function_level_import_counts(root)
    path.write_text("".join(f"{name} {count}\n" for name, count in counts.items()), encoding="utf-8")
    return counts


def over_baseline(found: list[str], baseline: dict[str, int]) -> list[str]:
    """One message per file with more function-level project imports than its baseline, each import named."""
    by_file: dict[str, list[str]] = {}
    for entry in found:
        by_file.setdefault(entry.rsplit(":", 1)[0], []).append(entry)
    return [
        f"{name}: {len(entries)} function-level imports of project modules, baseline {baseline.get(name, 0)}:\n  "
        + "\n  ".join(entries)
        for name, entries in sorted(by_file.items())
        if len(entries) > baseline.get(name, 0)
    ]


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


def _index_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == "index" and len(parts) > 1 else None


def rank_violations(graph: dict[str, set[str]], ranks: dict[str, int] = INDEX_RANKS) -> list[str]:
    """Imports between parts of ``index`` that do not point strictly down, and each module of a part with
    no rank that imports another part (an unranked part's empty ``__init__`` has no import to judge;
    :func:`test_index_parts_import_only_downward` names every unranked part anyway)."""
    found = []
    for module, deps in sorted(graph.items()):
        part = _index_part(module)
        if part is None:
            continue
        if part not in ranks:
            if any(_index_part(dep) not in (None, part) for dep in deps):  # it imports another part
                found.append(f"{module}: index part {part!r} has no rank in INDEX_RANKS (index/__init__.py)")
            continue
        for dep in sorted(deps):
            other = _index_part(dep)
            if other is None or other == part or other not in ranks:
                continue
            if ranks[other] >= ranks[part]:
                found.append(f"{module} ({part}, rank {ranks[part]}) imports {dep} ({other}, rank {ranks[other]})")
    return found


def test_no_import_cycle_anywhere_in_the_house() -> None:
    graph = import_graph(ROOT)
    assert graph, "no project modules found"
    cycle = find_cycle(graph)
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_index_parts_import_only_downward() -> None:
    graph = import_graph(ROOT, ("index",))
    present = {_index_part(m) for m in graph} - {None}
    assert present <= set(INDEX_RANKS), f"unranked parts of index: {present - set(INDEX_RANKS)}"
    assert not rank_violations(graph), "\n".join(rank_violations(graph))


def test_no_new_function_level_import_of_a_project_module() -> None:
    """A function-level import of our own code is how a cycle hides from a reader. Those that stay —
    mostly bench scripts and CLI handlers that import heavy modules only when they run, so ``--help``
    is fast and a torch-free path stays torch-free — are counted per file in
    tests/function_level_imports.txt; a file with more than its count fails here.

    After a justified change (a lazy import kept for start-up time, or lazy imports removed) regenerate
    the baseline with ``python tests/test_import_rules.py --write-baseline`` and say why in the commit.
    """
    problems = over_baseline(function_level_imports(ROOT), read_baseline())
    assert not problems, (
        "more function-level imports of project modules than tests/function_level_imports.txt allows:\n"
        + "\n".join(problems)
        + "\nimport at the top, or move the shared name down a layer; if it is lazy for start-up time, "
        "raise the baseline with a reason in the commit (python tests/test_import_rules.py --write-baseline)"
    )


def test_the_baseline_check_names_the_file_and_line(tmp_path: Path) -> None:
    """The baseline check itself: a file over its count, or not listed at all, fails naming file:line."""
    (tmp_path / "bench").mkdir()
    (tmp_path / "bench" / "a.py").write_text("def f():\n    import bench.b\n    from bench import c\n")
    (tmp_path / "bench" / "b.py").write_text("def g():\n    import bench.c\n")
    (tmp_path / "bench" / "c.py").write_text("")
    found = function_level_imports(tmp_path, ("bench",))
    assert function_level_import_counts(tmp_path, ("bench",)) == {"bench/a.py": 2, "bench/b.py": 1}
    assert over_baseline(found, {"bench/a.py": 2, "bench/b.py": 1}) == []
    assert over_baseline(found, {"bench/a.py": 1}) == [
        "bench/a.py: 2 function-level imports of project modules, baseline 1:\n"
        "  bench/a.py:2 -> bench.b\n  bench/a.py:3 -> bench.c",
        "bench/b.py: 1 function-level imports of project modules, baseline 0:\n  bench/b.py:2 -> bench.c",
    ]
    baseline = tmp_path / "baseline.txt"
    assert write_baseline(baseline, tmp_path) == {"bench/a.py": 2, "bench/b.py": 1}
    assert baseline.read_text() == "bench/a.py 2\nbench/b.py 1\n"
    assert read_baseline(baseline) == {"bench/a.py": 2, "bench/b.py": 1}


def test_checker_finds_cycles_upward_imports_and_lazy_imports(tmp_path: Path) -> None:
    """The checker itself, on a house built to break every rule: a circle through a lazy import, an
    upward import between index parts, an import between two parts of one rank, an unranked part."""
    for folder in ("index/bundle", "index/runtime", "index/items", "index/engines", "index/moments", "index/extra"):
        (tmp_path / folder).mkdir(parents=True)
        (tmp_path / folder / "__init__.py").write_text("")
    (tmp_path / "index" / "__init__.py").write_text("")
    (tmp_path / "index/bundle/format.py").write_text("def verify():\n    from index.runtime.loader import LoadedBundle\n")
    (tmp_path / "index/runtime/loader.py").write_text("from index.engines import milvus_index\n")
    (tmp_path / "index/engines/milvus_index.py").write_text("from index.bundle import format as fmt\nimport index.moments.windows\n")
    (tmp_path / "index/moments/windows.py").write_text("import numpy\n")
    (tmp_path / "index/items/log.py").write_text("import index.runtime.loader\n")
    (tmp_path / "index/extra/thing.py").write_text("import index.bundle.format\n")
    graph = import_graph(tmp_path, ("index",))
    assert find_cycle(graph) == [
        "index.bundle.format", "index.runtime.loader", "index.engines.milvus_index", "index.bundle.format"]
    assert rank_violations(graph) == [
        "index.bundle.format (bundle, rank 3) imports index.runtime.loader (runtime, rank 6)",
        "index.extra.thing: index part 'extra' has no rank in INDEX_RANKS (index/__init__.py)",
        "index.items.log (items, rank 6) imports index.runtime.loader (runtime, rank 6)",
    ]
    assert function_level_imports(tmp_path, ("index",)) == ["index/bundle/format.py:2 -> index.runtime.loader"]
    (tmp_path / "index/bundle/format.py").write_text("import numpy\n")
    assert find_cycle(import_graph(tmp_path, ("index",))) is None


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the import rules' baseline of function-level imports")
    parser.add_argument("--write-baseline", action="store_true",
                        help=f"rewrite {BASELINE.relative_to(ROOT)} from the tree as it is")
    args = parser.parse_args(argv)
    counts = write_baseline() if args.write_baseline else function_level_import_counts(ROOT)
    print(f"{sum(counts.values())} function-level imports of project modules in {len(counts)} files"
          + (f" (written to {BASELINE.relative_to(ROOT)})" if args.write_baseline else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
