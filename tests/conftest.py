"""Shared session fixtures: a tiny synthetic corpus and a tiny trained checkpoint.

Both are built once per test session in a temporary directory and reused by every
part's tests (training, export, service). Treat them as read-only.
"""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TINY_CONFIG = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Manifest path of `tonearm synth --size tiny --seed 0` (train/val/test splits, 8 languages)."""
    from training.data.synth import generate_corpus

    return generate_corpus(size="tiny", seed=0, out_dir=tmp_path_factory.mktemp("tiny_corpus"))


@pytest.fixture(scope="session")
def tiny_run(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run directory of configs/tiny.yaml trained on `tiny_corpus` (best/, last/, metrics.jsonl, curves.png)."""
    from training.config import load_train_config
    from training.loop import train

    out_dir = tmp_path_factory.mktemp("tiny_run")
    cfg = load_train_config(TINY_CONFIG, [f"data.manifest={tiny_corpus}", f"out_dir={out_dir}"])
    return train(cfg)


@pytest.fixture(scope="session")
def tiny_checkpoint(tiny_run: Path) -> Path:
    """Checkpoint directory (`best/`) of the tiny run: load with training.checkpoint.load_checkpoint."""
    return tiny_run / "best"


@pytest.fixture(scope="session")
def tiny_bundle(tiny_checkpoint: Path, tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Bundle directory exported with the defaults (exact Flat indices, fp32 encoders)."""
    from training.export import export_bundle

    out_dir = tmp_path_factory.mktemp("bundles")
    return export_bundle(tiny_checkpoint, manifest=tiny_corpus, out_dir=out_dir, progress=False)


@pytest.fixture(scope="session")
def demo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`$TONEARM_HOME` holding the real demo bundle, built once per session by the path `tonearm serve`
    takes (synth small → configs/demo.yaml → export; about 5 minutes on two idle cores).

    ``TONEARM_DEMO_TEST_HOME`` points it at a home whose demo is already built (a CI cache, a
    developer's ~/.cache/tonearm): the build is skipped when that home holds the current recipe."""
    import os

    from tonearm.demo import ensure_demo_bundle

    given = os.environ.get("TONEARM_DEMO_TEST_HOME")
    home = Path(given) if given else tmp_path_factory.mktemp("demo_home")
    ensure_demo_bundle(home)
    return home
