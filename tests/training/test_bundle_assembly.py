"""One way a bundle is assembled (issue 56): trained and pretrained exports hand what differs to
:func:`training.bundle.assemble.assemble_bundle`, the only code in ``training`` that builds a
:class:`index.bundle.format.BundleManifest` or writes a bundle's sections.

* structural: no module of ``training`` but ``training/bundle/assemble.py`` names ``BundleManifest``, and
  neither ``export.py`` nor ``pretrained.py`` names a manifest section's model, publishes, stages or writes
  the indices, held-out set or windows itself — both call ``assemble_bundle``;
* behavioural: a small trained and a small pretrained export each build their manifest once, through
  :func:`training.bundle.assemble.bundle_manifest`, and their manifests have the same keys and the same
  keys in every section both have;
* the steps' options: both exports' steps extend :class:`training.bundle.assemble.StepOptions` (the
  quantization, providers, Ray, precision, chunk files, pass options and ``limits``), declared once.

The exports: the tiny checkpoint and a small random CLAP folder (0.37 M parameters) over six clips,
~40 s together on 2 cores.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from training.bundle.assemble import StepOptions
from training.bundle.export import TrainedSteps
from training.bundle.pretrained import PretrainedSteps

ROOT = Path(__file__).resolve().parents[2]
BUNDLE = ROOT / "training" / "bundle"
ASSEMBLY = BUNDLE / "assemble.py"
EXPORTS = (BUNDLE / "export.py", BUNDLE / "pretrained.py")

ASSEMBLY_ONLY = {
    "BundleManifest", "SourceInfo", "EncoderInfo", "TokenizerInfo", "EvalSetInfo",  # the manifest and its sections
    "publish", "staged_bundle",  # the staging folder and its publication
    "write_catalogue", "write_eval_set", "export_windows", "embed_catalogue",  # the sections' files
    "make_bundle_id", "partial_base", "resumable",  # the bundle's name and its resumable pass
}
"""Names only the assembly uses: an export naming one is assembling a bundle on its own again."""


def names_used(path: Path) -> set[str]:
    """Every name and attribute a module mentions or imports."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
        if isinstance(node, ast.Name):
            found.add(node.id)
        elif isinstance(node, ast.Attribute):
            found.add(node.attr)
        elif isinstance(node, ast.ImportFrom):
            found |= {alias.name for alias in node.names}
    return found


def test_only_the_assembly_builds_a_manifest() -> None:
    builders = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "training").rglob("*.py")
                      if p != ASSEMBLY and "BundleManifest" in names_used(p))
    assert builders == [], f"BundleManifest outside training/bundle/assemble.py: {builders}"
    assert "BundleManifest" in names_used(ASSEMBLY)


@pytest.mark.parametrize("path", EXPORTS, ids=lambda p: p.name)
def test_trained_and_pretrained_exports_hand_their_bundle_to_the_one_assembly(path: Path) -> None:
    used = names_used(path)
    assert not used & ASSEMBLY_ONLY, f"{path.name} assembles on its own: {sorted(used & ASSEMBLY_ONLY)}"
    assert {"assemble_bundle", "ModelDescription", "StagedEncoders", "CataloguePass"} <= used


def test_the_bundle_folder_says_which_file_does_what() -> None:
    import training.bundle

    doc = training.bundle.__doc__ or ""
    files = sorted(p.stem for p in BUNDLE.glob("*.py") if p.stem != "__init__")
    assert [name for name in files if f"training.bundle.{name}" not in doc] == []


@pytest.mark.parametrize(("steps", "own"), [(TrainedSteps, ["ckpt"]), (PretrainedSteps, ["clap", "languages"])],
                         ids=["trained", "pretrained"])
def test_both_exports_steps_take_their_options_from_one_base(steps: type, own: list[str]) -> None:
    """The six options and ``limits`` were written out twice (TrainedSteps, PretrainedSteps)."""
    shared = [f.name for f in dataclasses.fields(StepOptions)]
    assert shared == ["quantize", "providers", "ray", "precision", "chunk_files", "pass_options"]
    assert issubclass(steps, StepOptions) and "limits" not in vars(steps)
    assert list(vars(steps).get("__annotations__", {})) == own  # only its model is its own
    params = inspect.signature(steps).parameters
    assert [n for n, p in params.items() if p.kind is p.POSITIONAL_OR_KEYWORD] == own  # the model first
    assert [n for n, p in params.items() if p.kind is p.KEYWORD_ONLY] == shared


# ----------------------------------------------------------------------------- behaviour


@pytest.fixture(scope="module")
def manifests(tiny_checkpoint: Path, real_manifest: Path,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """``{"trained": manifest.json, "pretrained": manifest.json, "built": [run names]}``: one export of each
    kind, with every call of :func:`training.bundle.assemble.bundle_manifest` recorded."""
    from tests.training.test_pretrained_quantize import write_small_clap
    from training.bundle import assemble
    from training.bundle.export import export_bundle
    from training.bundle.pretrained import export_pretrained_bundle

    base = tmp_path_factory.mktemp("assembly")
    built: list[str] = []
    build = assemble.bundle_manifest

    def recorded(model: assemble.ModelDescription, *args: Any, **kwargs: Any) -> Any:
        built.append(model.name)
        return build(model, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(assemble, "bundle_manifest", recorded)
        trained = export_bundle(tiny_checkpoint, manifest=real_manifest, out_dir=base / "trained", progress=False)
        pretrained = export_pretrained_bundle(write_small_clap(base / "small_clap"), manifest=real_manifest,
                                              out_dir=base / "pretrained", progress=False)
    yield {"trained": json.loads((trained / "manifest.json").read_text()),
           "pretrained": json.loads((pretrained / "manifest.json").read_text()), "built": built}


def test_each_export_builds_its_manifest_once_through_the_assembly(manifests: dict[str, Any]) -> None:
    assert len(manifests["built"]) == 2
    assert manifests["built"][1] == "pretrained-small_clap"
    assert [m["source"]["run_name"] for m in (manifests["trained"], manifests["pretrained"])] == manifests["built"]


FREE_FORM = {"train_config", "objective", "frontend", "files"}
"""Sections whose keys are the model's own (its config, its feature extractor's settings) or the files'."""


def test_trained_and_pretrained_manifests_have_the_same_sections(manifests: dict[str, Any]) -> None:
    trained, pretrained = manifests["trained"], manifests["pretrained"]
    assert list(trained) == list(pretrained)  # the same keys, in the same order
    both = [key for key in trained if isinstance(trained[key], dict) and isinstance(pretrained[key], dict)
            and key not in FREE_FORM]
    assert {"source", "audio_encoder", "text_encoder", "tokenizer", "audio_index", "text_index", "eval_set",
            "evaluation"} <= set(both)  # moments: None in both (the clips are shorter than a window)
    for key in both:
        assert sorted(trained[key]) == sorted(pretrained[key]), key
    assert trained["evaluation"]["report"].keys() == pretrained["evaluation"]["report"].keys()
