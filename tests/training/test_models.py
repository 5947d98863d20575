"""Built-in towers and the dual encoder: shapes, normalisation, masking, gradients, learning."""

from __future__ import annotations

import math

import pytest
import torch

from training.config import AudioTowerConfig, FrontendConfig, ModelConfig, TextTowerConfig
from training.models.audio_cnn import AudioCNN
from training.models.dual_encoder import DualEncoder, build_dual_encoder, trim_right_padding
from training.models.text_transformer import TextTransformer

TINY = ModelConfig(
    embed_dim=16,
    audio=AudioTowerConfig(channels=[8, 16], dropout=0.0),
    text=TextTowerConfig(width=32, layers=2, heads=2, max_length=12, dropout=0.0),
)


def padded(rows: list[list[int]], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded (ids, mask) with pad id 0."""
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask


@pytest.fixture()
def model() -> DualEncoder:
    torch.manual_seed(0)
    return build_dual_encoder(TINY, FrontendConfig(), vocab_size=50).eval()


@pytest.mark.parametrize("samples", [400, 16000, 80000, 112000])
def test_audio_embeddings_are_unit_vectors_for_any_length(model: DualEncoder, samples: int) -> None:
    with torch.no_grad():
        emb = model.encode_audio(0.1 * torch.randn(3, samples))
    assert emb.shape == (3, 16)
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3))


def test_audio_cnn_default_widths_and_output_size() -> None:
    tower = AudioCNN(AudioTowerConfig(), FrontendConfig())
    assert tower.out_dim == 2 * 192
    with torch.no_grad():
        assert tower.eval()(torch.zeros(2, 80000)).shape == (2, 384)


def test_audio_batch_items_are_independent_in_eval(model: DualEncoder) -> None:
    wave = 0.1 * torch.randn(3, 16000, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model.encode_audio(wave)[2:], model.encode_audio(wave[2:]))


def test_text_padding_does_not_change_embeddings(model: DualEncoder) -> None:
    rows = [[1, 5, 6, 7, 2], [1, 9, 2]]
    short, long = padded(rows, 5), padded(rows, 12)
    with torch.no_grad():
        a = model.text_module()(*short)
        b = model.text_module()(*long)
        c = model.encode_text(*long)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(b.norm(dim=-1), torch.ones(2))


def test_padded_token_ids_are_ignored(model: DualEncoder) -> None:
    ids, mask = padded([[1, 5, 6, 2]], 12)
    garbage = ids.clone()
    garbage[0, 4:] = 33  # whatever sits under mask 0 must not matter
    with torch.no_grad():
        torch.testing.assert_close(
            model.text_module()(ids, mask), model.text_module()(garbage, mask)
        )


def test_trim_right_padding() -> None:
    ids, mask = padded([[1, 2, 3], [1, 2]], 8)
    t_ids, t_mask = trim_right_padding(ids, mask)
    assert t_ids.shape == (2, 3) and t_mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    left = torch.tensor([[0, 1, 1], [1, 1, 1]])
    assert trim_right_padding(left, left)[1] is left  # nothing to trim
    ragged = torch.tensor([[1, 0, 1, 0]])
    assert trim_right_padding(ragged, ragged)[1] is ragged  # holes: left untouched


def test_cls_pooling_reads_the_first_token() -> None:
    torch.manual_seed(0)
    tower = TextTransformer(TINY.text.model_copy(update={"pooling": "cls"}), vocab_size=50).eval()
    ids, mask = padded([[1, 5, 6, 2]], 6)
    with torch.no_grad():
        hidden = tower.token_emb(ids) + tower.pos_emb[:6]
        bias = (1.0 - mask.float())[:, None, None, :] * -1e9
        for block in tower.blocks:
            hidden = block(hidden, bias)
        torch.testing.assert_close(tower(ids, mask), tower.norm(hidden)[:, 0])


def test_every_parameter_gets_a_gradient(model: DualEncoder) -> None:
    model.train()
    ids, mask = padded([[1, 5, 6, 2], [1, 7, 2], [1, 8, 9, 10, 11, 2]], 12)
    audio, text = model(0.1 * torch.randn(3, 8000), ids, mask)
    (audio * text).sum().backward()
    missing = [
        n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0
    ]
    assert missing == []


def test_tiny_dual_encoder_learns_to_match_tones_and_words() -> None:
    """Four tones ↔ four one-word captions: a few InfoNCE steps reach perfect retrieval."""
    torch.manual_seed(0)
    model = build_dual_encoder(TINY, FrontendConfig(), vocab_size=20)
    t = torch.arange(8000) / 16000
    waves = torch.stack([torch.sin(2 * math.pi * hz * t) for hz in (250.0, 700.0, 1800.0, 4500.0)])
    ids, mask = padded([[1, 3 + i, 2] for i in range(4)], 12)
    optim = torch.optim.Adam(model.parameters(), lr=3e-3)
    target = torch.arange(4)
    for _ in range(40):
        audio, text = model(waves + 0.01 * torch.randn_like(waves), ids, mask)
        logits = audio @ text.T / 0.1
        loss = (
            torch.nn.functional.cross_entropy(logits, target)
            + torch.nn.functional.cross_entropy(logits.T, target)
        ) / 2
        optim.zero_grad()
        loss.backward()
        optim.step()
    with torch.no_grad():  # "precise BN": running stats of the final weights (they moved fast)
        for module in model.modules():
            if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
                module.reset_running_stats()
                module.momentum = None
        model(waves, ids, mask)
    model.eval()
    with torch.no_grad():
        scores = model.encode_audio(waves) @ model.encode_text(ids, mask).T
    assert scores.argmax(dim=1).tolist() == [0, 1, 2, 3]
    assert scores.argmax(dim=0).tolist() == [0, 1, 2, 3]


def test_default_model_sizes() -> None:
    model = build_dual_encoder(ModelConfig(), FrontendConfig(), vocab_size=4000)
    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    # documented in docs/models.md; keep the towers small enough for CPU training
    assert 0.5e6 < count(model.audio) < 1.5e6
    assert 1.5e6 < count(model.text) < 3e6
    assert model.embed_dim == 256
