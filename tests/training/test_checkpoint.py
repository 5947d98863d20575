"""Checkpoints: safetensors + JSON round trip, atomic replacement, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from index.bundle.tokenizer import TextTokenizer
from tonearm.errors import TonearmError
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import AudioTowerConfig, ModelConfig, TextTowerConfig, TrainConfig
from training.models.dual_encoder import DualEncoder, build_dual_encoder
from training.models.tokenizer import train_bpe_tokenizer

CONFIG = TrainConfig(
    seed=3,
    model=ModelConfig(
        embed_dim=16,
        audio=AudioTowerConfig(channels=[8, 16]),
        text=TextTowerConfig(width=32, layers=1, heads=2, max_length=10, vocab_size=300),
    ),
)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    texts = ["a dog barks", "un chien aboie", "ein hund bellt", "犬が吠える", "狗在叫"] * 4
    return train_bpe_tokenizer(texts, vocab_size=300, max_length=10)


@pytest.fixture()
def model(tokenizer: TextTokenizer) -> DualEncoder:
    torch.manual_seed(0)
    model = build_dual_encoder(CONFIG.model, CONFIG.frontend, vocab_size=tokenizer.vocab_size)
    model.train()
    with torch.no_grad():  # non-trivial BatchNorm running statistics must survive too
        model.encode_audio(torch.randn(4, 8000))
    return model.eval()


def embeddings(model: DualEncoder, tokenizer: TextTokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    ids, mask = tokenizer.encode(["a dog barks", "狗在叫"])
    wave = torch.randn(2, 8000, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model.encode_audio(wave), model.encode_text(
            torch.from_numpy(ids), torch.from_numpy(mask)
        )


def test_round_trip_restores_model_config_tokenizer_and_state(
    tmp_path: Path, model: DualEncoder, tokenizer: TextTokenizer
) -> None:
    state = {"epoch": 4, "step": 120, "best": {"t2a_R@10_mean": 0.5}}
    out = save_checkpoint(
        tmp_path / "best", model=model, config=CONFIG, tokenizer=tokenizer, state=state
    )
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "state.json",
        "tokenizer.json",
    ]
    loaded = load_checkpoint(out)
    assert loaded.config == CONFIG and loaded.state == state
    assert not loaded.model.training
    texts = ["a dog barks", "犬が吠える"]
    for got, expected in zip(loaded.tokenizer.encode(texts), tokenizer.encode(texts), strict=True):
        assert (got == expected).all()
    for got, expected in zip(
        embeddings(loaded.model, loaded.tokenizer), embeddings(model, tokenizer), strict=True
    ):
        torch.testing.assert_close(got, expected)


def test_saving_over_an_existing_checkpoint_replaces_it(
    tmp_path: Path, model: DualEncoder, tokenizer: TextTokenizer
) -> None:
    target = tmp_path / "last"
    save_checkpoint(target, model=model, config=CONFIG, tokenizer=tokenizer, state={"epoch": 1})
    (target / "stale.txt").write_text("from the previous save")
    save_checkpoint(target, model=model, config=CONFIG, tokenizer=tokenizer, state={"epoch": 2})
    assert load_checkpoint(target).state == {"epoch": 2}
    assert not (target / "stale.txt").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["last"]  # no temp or old directories left


def test_missing_directory_and_files_are_user_errors(
    tmp_path: Path, model: DualEncoder, tokenizer: TextTokenizer
) -> None:
    with pytest.raises(TonearmError, match="not found"):
        load_checkpoint(tmp_path / "nowhere")
    out = save_checkpoint(tmp_path / "ckpt", model=model, config=CONFIG, tokenizer=tokenizer)
    (out / "model.safetensors").unlink()
    with pytest.raises(TonearmError, match=r"incomplete: missing model\.safetensors"):
        load_checkpoint(out)


def test_weights_that_do_not_match_the_config_are_user_errors(
    tmp_path: Path, model: DualEncoder, tokenizer: TextTokenizer
) -> None:
    out = save_checkpoint(tmp_path / "ckpt", model=model, config=CONFIG, tokenizer=tokenizer)
    config = json.loads((out / "config.json").read_text())
    config["model"]["text"]["layers"] = 2
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(TonearmError, match="do not match"):
        load_checkpoint(out)
    config["model"]["text"]["layers"] = "many"
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(TonearmError, match="config.json is invalid"):
        load_checkpoint(out)
