"""Training on real datasets without hand-made manifests: a language subset, a carved validation split,
and exporting only some splits."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from tests.conftest import TINY_CONFIG
from tonearm.cli import main
from tonearm.errors import BundleError, DataError
from training.config import DataConfig
from training.data.manifest import load_manifest
from training.data.splits import carve_validation, select_split

SMALL_RUN = ["optim.epochs=1", "optim.batch_size=4", "optim.warmup_steps=1", "eval.batch_size=64"]


def test_drop_other_languages_counts_what_it_drops(tiny_corpus: Path, caplog: pytest.LogCaptureFixture) -> None:
    with pytest.raises(DataError, match="'cat', which is not among the configured languages.*data.drop_other_languages=true"):
        load_manifest(tiny_corpus, languages=["eng"])
    every = load_manifest(tiny_corpus, languages=["eng", "fra", "deu", "spa", "nld", "cat", "jpn", "zho"])
    others = sum(len(texts) for r in every for lang, texts in r.captions.items() if lang != "eng")
    with caplog.at_level(logging.INFO, logger="training.data.manifest"):
        english = load_manifest(tiny_corpus, languages=["eng"], drop_other_languages=True)
    assert [r.id for r in english] == [r.id for r in every if "eng" in r.captions]
    assert all(list(r.captions) == ["eng"] for r in english)
    assert f"dropped {others} captions in languages outside data.languages" in caplog.text


def test_carved_validation_is_seeded_disjoint_and_leaves_the_rest_to_train(tiny_corpus: Path) -> None:
    records = load_manifest(tiny_corpus, languages=["eng"], drop_other_languages=True)
    train = [r for r in records if r.split == "train"]
    rest, val = carve_validation(train, fraction=0.25, seed=0)
    assert len(val) == round(0.25 * len(train)) and len(rest) + len(val) == len(train)
    assert not {r.id for r in rest} & {r.id for r in val}
    assert [r.id for r in carve_validation(train, fraction=0.25, seed=0)[1]] == [r.id for r in val]
    assert [r.id for r in carve_validation(train, fraction=0.25, seed=1)[1]] != [r.id for r in val]
    cfg = DataConfig(languages=["eng"], val_fraction=0.25)
    assert select_split(records, "val", data_cfg=cfg, eval_split="val") == val  # not the manifest's val clips
    assert select_split(records, "test", data_cfg=cfg, eval_split="val") == [r for r in records if r.split == "test"]
    with pytest.raises(DataError, match="data.val_fraction=0.97 leaves 1 of 32 train clips"):
        carve_validation(train[:32], fraction=0.97, seed=0)


def test_english_only_run_on_a_train_only_multilingual_manifest(
    tiny_corpus: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    """Clotho-development style: one split, 8 languages; train and evaluate on English with val carved."""
    lines = [json.loads(line) for line in tiny_corpus.read_text().splitlines()]
    manifest = tmp_path / "manifest.jsonl"
    manifest.write_text("".join(
        json.dumps({**obj, "audio": str(tiny_corpus.parent / obj["audio"])}) + "\n"
        for obj in lines if obj["split"] == "train"
    ))
    run = tmp_path / "run"
    args = ["train", str(TINY_CONFIG), f"data.manifest={manifest}", f"out_dir={run}", *SMALL_RUN,
            "data.languages=[eng]", "data.val_fraction=0.25", "--drop-other-languages"]
    with caplog.at_level(logging.INFO):
        assert main(args) == 0
    assert "embedding captions" in capsys.readouterr().err  # validation shows its progress
    assert "validation: 8 clips carved from train (data.val_fraction=0.25)" in caplog.text
    evals = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    assert len(evals) == 1 and set(evals[0]) >= {"t2a_R@1_eng", "t2a_R@10_mean"}
    assert not any("fra" in key for key in evals[0])
    # `tonearm evaluate --split val` scores the same carved clips the run validated on.
    assert main(["evaluate", str(run / "best"), "--data", str(manifest), "--split", "val", "--out", str(tmp_path / "ev")]) == 0
    err = capsys.readouterr().err  # evaluate shows its progress (clips decode inside the embedding pass)
    assert all(part in err for part in ("embedding clips", "embedding captions")), err
    report = json.loads((tmp_path / "ev" / "report.json").read_text())
    assert report["languages"] == ["eng"]
    assert report["metrics"]["t2a_R@10_mean"] == pytest.approx(evals[0]["t2a_R@10_mean"], abs=1e-6)


def test_export_indexes_only_the_requested_split(tiny_checkpoint: Path, tiny_corpus: Path, tmp_path: Path) -> None:
    from index.runtime.verify import verify_bundle
    from training.bundle.export import export_bundle

    assert main(["export", str(tiny_checkpoint), "--data", str(tiny_corpus), "--out", str(tmp_path), "--split", "test"]) == 0
    (path,) = list(tmp_path.iterdir())
    test_ids = [json.loads(line)["id"] for line in tiny_corpus.read_text().splitlines() if '"split": "test"' in line]
    assert test_ids and verify_bundle(path).audio_index.ntotal == len(test_ids)
    indexed = [json.loads(line)["id"] for line in (path / "audio_ids.jsonl").read_text().splitlines()]
    assert indexed == test_ids
    with pytest.raises(BundleError, match=r"no split 'tset' to index \(--split; splits present: test, train, val\)"):
        export_bundle(tiny_checkpoint, manifest=tiny_corpus, out_dir=tmp_path / "b", splits=["tset"], progress=False)
