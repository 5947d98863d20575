"""Training loop: exact resume, outputs of a run, and clear errors for bad input (exit 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import TINY_CONFIG
from tonearm.cli import main
from training.config import load_train_config
from training.loop import train
from training.observe import TIMING_KEYS

# 12 training clips in batches of 4: 3 steps per epoch, 2 epochs.
SMALL_RUN = ["optim.epochs=2", "optim.batch_size=4", "data.max_clips=12", "optim.warmup_steps=1"]


def _config(manifest: Path, out_dir: Path, *overrides: str):  # noqa: ANN202
    return load_train_config(
        TINY_CONFIG, [f"data.manifest={manifest}", f"out_dir={out_dir}", *SMALL_RUN, *overrides]
    )


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_resume_matches_an_uninterrupted_run(tiny_corpus: Path, tmp_path: Path) -> None:
    full = train(_config(tiny_corpus, tmp_path / "full"))
    split = tmp_path / "split"
    train(_config(tiny_corpus, split), interrupt_after_steps=4)  # mid-way through epoch 2
    saved = json.loads((split / "last" / "trainer_state.json").read_text())
    assert saved["loop"]["step"] == 4 and saved["loop"]["batch_in_epoch"] == 1
    train(_config(tiny_corpus, split, "resume=true"))

    expected = load_file(str(full / "last" / "model.safetensors"))
    resumed = load_file(str(split / "last" / "model.safetensors"))
    assert expected.keys() == resumed.keys()
    for name, tensor in expected.items():
        assert (tensor == resumed[name]).all(), name
    optim_full = load_file(str(full / "last" / "trainer_state.safetensors"))
    optim_split = load_file(str(split / "last" / "trainer_state.safetensors"))
    for name, tensor in optim_full.items():
        if name.startswith(("optim.", "objective.")):
            assert (tensor == optim_split[name]).all(), name
    assert json.loads((split / "last" / "trainer_state.json").read_text())["loop"]["step"] == 6
    # The metrics log holds each record once, identical to the uninterrupted run's.
    # (timings differ between any two runs: epoch seconds, samples/s, data wait, peak memory)
    strip = [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in _records(full)]
    assert strip == [{k: v for k, v in r.items() if k not in TIMING_KEYS} for r in _records(split)]


def test_run_writes_checkpoints_metrics_and_curves(tiny_run: Path) -> None:
    for name in ("best", "last"):
        for file in ("model.safetensors", "config.json", "tokenizer.json", "state.json"):
            assert (tiny_run / name / file).is_file(), f"{name}/{file}"
    records = _records(tiny_run)
    kinds = [r["kind"] for r in records]
    cfg = load_train_config(TINY_CONFIG)
    assert kinds.count("epoch") == cfg.optim.epochs
    assert kinds.count("eval") == cfg.optim.epochs  # eval.every_epochs = 1
    first_step = next(r for r in records if r["kind"] == "step")
    assert first_step["step"] == 1 and first_step["infonce_loss"] > 0 and first_step["lr"] > 0
    evals = [r for r in records if r["kind"] == "eval"]
    assert all(0.0 <= r["t2a_R@10_mean"] <= 1.0 for r in evals)
    best_state = json.loads((tiny_run / "best" / "state.json").read_text())
    assert best_state["metrics"]["t2a_R@10_mean"] == max(r["t2a_R@10_mean"] for r in evals)
    assert (tiny_run / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# --- bad input: a message and exit status 2, never a traceback -------------------------------


def _train_cli(manifest: Path | str, out_dir: Path, *overrides: str) -> int:
    return main(
        [
            "train",
            str(TINY_CONFIG),
            f"data.manifest={manifest}",
            f"out_dir={out_dir}",
            *SMALL_RUN,
            *overrides,
        ]
    )


def _rewrite(manifest: Path, target: Path, edit) -> Path:  # noqa: ANN001
    """Copy `manifest` to `target` with absolute audio paths, applying `edit(line_number, obj)`."""
    lines = []
    for number, line in enumerate(manifest.read_text(encoding="utf-8").splitlines()):
        obj = json.loads(line)
        obj["audio"] = str(manifest.parent / obj["audio"])
        edit(number, obj)
        lines.append(json.dumps(obj, ensure_ascii=False))
    target.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


def test_unknown_config_key(
    tiny_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train_cli(tiny_corpus, tmp_path, "optim.learning_rate=1") == 2
    assert "unknown key 'optim.learning_rate'" in capsys.readouterr().err


def test_unknown_select_metric(
    tiny_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _train_cli(tiny_corpus, tmp_path, "eval.select_metric=t2a_R@3_mean") == 2
    assert "eval.select_metric 't2a_R@3_mean'" in capsys.readouterr().err


def test_missing_manifest(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train_cli(tmp_path / "nowhere.jsonl", tmp_path) == 2
    assert "nowhere.jsonl" in capsys.readouterr().err


def test_language_outside_configured_set(
    tiny_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def add_italian(number: int, obj: dict) -> None:
        if number == 3:
            obj["captions"]["ita"] = ["un cane abbaia"]

    manifest = _rewrite(tiny_corpus, tmp_path / "manifest.jsonl", add_italian)
    assert _train_cli(manifest, tmp_path / "run") == 2
    assert "'ita'" in capsys.readouterr().err


def test_configured_language_without_captions(
    tiny_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (
        _train_cli(
            tiny_corpus, tmp_path, "data.languages=[eng, fra, deu, spa, nld, cat, jpn, zho, ita]"
        )
        == 2
    )
    assert "ita" in capsys.readouterr().err


def test_missing_audio_file(
    tiny_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    def break_path(number: int, obj: dict) -> None:
        if number == 0:
            obj["audio"] = str(tmp_path / "gone.wav")

    manifest = _rewrite(tiny_corpus, tmp_path / "manifest.jsonl", break_path)
    assert _train_cli(manifest, tmp_path / "run") == 2
    assert "gone.wav" in capsys.readouterr().err


def test_unreadable_wav(
    tiny_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.wav"
    bad.write_bytes(b"RIFF\x00\x00\x00\x00this is not audio at all")

    def corrupt_train_clips(number: int, obj: dict) -> None:
        if obj["split"] == "train":
            obj["audio"] = str(bad)

    manifest = _rewrite(tiny_corpus, tmp_path / "manifest.jsonl", corrupt_train_clips)
    assert _train_cli(manifest, tmp_path / "run") == 2
    assert "bad.wav" in capsys.readouterr().err


def test_loop_context_embeds_pairs_and_clips(tiny_checkpoint: Path, tiny_corpus: Path) -> None:
    import torch

    from training.checkpoint import load_checkpoint
    from training.context import LoopContext
    from training.data.manifest import load_manifest

    checkpoint = load_checkpoint(tiny_checkpoint)
    cfg, model, tokenizer = checkpoint.config, checkpoint.model.train(), checkpoint.tokenizer
    records = load_manifest(tiny_corpus, languages=cfg.data.languages, split="train")[:4]
    context = LoopContext(
        model=model,
        tokenizer=tokenizer,
        train_records=records,
        data_cfg=cfg.data,
        frontend_cfg=cfg.frontend,
        batch_size=8,
        device=torch.device("cpu"),
    )
    audio, text, clip = context.embed_training_pairs()
    n_pairs = sum(len(texts) for r in records for texts in r.captions.values())
    assert audio.shape == text.shape == (n_pairs, model.embed_dim) and clip.shape == (n_pairs,)
    assert model.training  # restored after embedding in eval mode
    assert torch.allclose(text.norm(dim=1), torch.ones(n_pairs), atol=1e-5)
    # Every pair of a clip carries that clip's audio embedding, the same embed_clips returns.
    clips = context.embed_clips(torch.tensor([2, 0]))
    assert torch.allclose(clips[0], audio[clip == 2][0], atol=1e-6)
    assert torch.allclose(audio[clip == 0], clips[1].expand(int((clip == 0).sum()), -1), atol=1e-6)
    # The first pair is clip 0's first caption in the first language, embedded in eval mode.
    ids, mask = tokenizer.encode([records[0].captions[cfg.data.languages[0]][0]])
    model.eval()
    with torch.no_grad():
        direct = model.encode_text(torch.from_numpy(ids), torch.from_numpy(mask))[0]
    assert torch.allclose(text[0], direct, atol=1e-5)
    all_audio, all_text = context.embed_manifest_pairs(tiny_corpus)
    total = sum(
        len(t)
        for r in load_manifest(tiny_corpus, languages=cfg.data.languages)
        for t in r.captions.values()
    )
    assert all_audio.shape == all_text.shape == (total, model.embed_dim)
