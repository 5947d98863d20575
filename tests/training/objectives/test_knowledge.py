"""ASK knowledge bases (training/knowledge.py): search, self-exclusion, prototypes, drift."""

from __future__ import annotations

import logging
import math

import pytest
import torch
import torch.nn.functional as F

from training.knowledge import (
    KBSide,
    build_coarse_kb,
    build_fine_kb,
    group_identical_rows,
    max_pool_prototypes,
    representation_drift,
)


def _unit(*rows: tuple[float, ...]) -> torch.Tensor:
    return F.normalize(torch.tensor(rows, dtype=torch.float32), dim=-1)


def test_search_is_by_inner_product_and_skips_own_clip() -> None:
    keys = _unit((1, 0), (0.8, 0.6), (0.6, 0.8), (0, 1), (0.99, 0.14))
    clip = torch.tensor([0, 1, 2, 3, 0])  # rows 0 and 4 are two captions of clip 0
    side = KBSide.create(keys, keys.clone(), clip)
    assert side.max_per_clip == 2
    query = _unit((1, 0), (0, 1))
    assert side.search(query, 3).tolist() == [[0, 4, 1], [3, 2, 1]]
    excluded = side.search(query, 3, exclude_clip=torch.tensor([0, 3]))
    assert excluded.tolist() == [[1, 2, 3], [2, 1, 4]]
    # A negative query id (a clip outside the training set) excludes nothing.
    assert side.search(query, 2, exclude_clip=torch.tensor([-1, -1])).tolist() == [[0, 4], [3, 2]]


def test_fine_kb_keeps_every_caption_and_one_audio_per_clip() -> None:
    audio = _unit((1, 0), (1, 0), (0, 1))
    text = _unit((1, 0), (0, 1), (0, 1))  # clip 0 has two captions
    kb = build_fine_kb(audio, text, torch.tensor([0, 0, 1]))
    assert len(kb.text) == 3 and len(kb.audio) == 2
    torch.testing.assert_close(kb.text.partners, audio)
    torch.testing.assert_close(kb.audio.keys, _unit((1, 0), (0, 1)))
    torch.testing.assert_close(kb.audio.partners, _unit((1, 1), (0, 1)))  # re-normalised mean caption
    assert kb.effective_k(10, exclude=True) == 1  # 2 clips on the audio side minus the own one
    assert kb.effective_k(10, exclude=False) == 2


def test_max_pool_prototypes_by_hand() -> None:
    emb = torch.tensor([[0.1, 0.9, -0.2], [0.5, 0.2, -0.1], [0.3, 0.3, 0.3]])
    protos = max_pool_prototypes(emb, torch.tensor([0, 0, 1]), 2)
    torch.testing.assert_close(protos[0], F.normalize(torch.tensor([0.5, 0.9, -0.1]), dim=0))
    torch.testing.assert_close(protos[1], F.normalize(torch.tensor([0.3, 0.3, 0.3]), dim=0))


def test_coarse_kb_prototypes_of_separated_clusters() -> None:
    gen = torch.Generator().manual_seed(0)
    centers = torch.eye(4)[:3] * 5
    members = torch.cat([c + 0.05 * torch.randn(10, 4, generator=gen) for c in centers])
    audio, text = F.normalize(members, dim=-1), F.normalize(members.flip(-1), dim=-1)
    kb = build_coarse_kb(audio, text, n_clusters=3, seed=0, redo=5)
    assert len(kb.audio) == 3
    expected_audio = sorted(F.normalize(audio[i * 10:(i + 1) * 10].max(0).values, dim=0).tolist() for i in range(3))
    got = sorted(kb.audio.keys.tolist())
    for row, exp in zip(got, expected_audio, strict=True):
        assert row == pytest.approx(exp, abs=1e-6)
    # Audio and text prototypes stay paired: each text prototype is its cluster's max-pooled text.
    for proto_audio, proto_text in zip(kb.audio.keys, kb.audio.partners, strict=True):
        cluster = int(torch.argmax(proto_audio[:3]))
        expected_text = F.normalize(text[cluster * 10:(cluster + 1) * 10].max(0).values, dim=0)
        torch.testing.assert_close(proto_text, expected_text)
    assert (kb.text.clip == -1).all()


def test_coarse_kb_clamps_the_number_of_clusters(caplog: pytest.LogCaptureFixture) -> None:
    gen = torch.Generator().manual_seed(1)
    audio = F.normalize(torch.randn(7, 8, generator=gen), dim=-1)
    with caplog.at_level(logging.INFO, logger="training.knowledge"):
        kb = build_coarse_kb(audio, audio.roll(1, 0), n_clusters=512, seed=0)
    assert 1 <= len(kb.audio) <= 7
    assert "512 clusters requested but only 7 pairs" in caplog.text


def test_representation_drift() -> None:
    gen = torch.Generator().manual_seed(2)
    current = F.normalize(torch.randn(5, 8, generator=gen), dim=-1)
    assert representation_drift(current, current) == pytest.approx(0.0, abs=1e-12)
    moved = F.normalize(current + 0.5 * torch.randn(5, 8, generator=gen), dim=-1)
    far = F.normalize(current + 2.0 * torch.randn(5, 8, generator=gen), dim=-1)
    assert 0 < representation_drift(current, moved) < representation_drift(current, far)
    # By hand for two clips on a line: e = [(1,0), (0,1)], stale o = [(0,1), (1,0)], tau = 1.
    e, o = torch.tensor([[1.0, 0.0], [0.0, 1.0]]), torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    p_ideal = [math.e / (math.e + 1), 1 / (math.e + 1)]
    p_actual = list(reversed(p_ideal))
    kl = sum(p * math.log(p / q) for p, q in zip(p_ideal, p_actual, strict=True))
    assert representation_drift(e, o) == pytest.approx(kl, rel=1e-9)


def test_group_identical_rows() -> None:
    audio = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 0.0]])
    ids = group_identical_rows(audio, offset=3)
    assert ids[0] == ids[2] != ids[1] and (ids <= -4).all()


def test_blocked_search_matches_the_faiss_flat_index(monkeypatch):
    """Parity of the optimised path: torch top-k over blocks == IndexFlatIP.search."""
    import training.knowledge as knowledge

    generator = torch.Generator().manual_seed(0)
    keys = torch.nn.functional.normalize(torch.randn(1000, 16, generator=generator), dim=1)
    queries = torch.nn.functional.normalize(torch.randn(7, 16, generator=generator), dim=1)
    side = knowledge.KBSide.create(keys, keys, torch.arange(1000))
    _, expected = side.index.search(queries.numpy(), 12)
    monkeypatch.setattr(knowledge, "SEARCH_BLOCK_ROWS", 96)  # many blocks, merged top-k
    assert torch.equal(side.search(queries, 12), torch.from_numpy(expected))
