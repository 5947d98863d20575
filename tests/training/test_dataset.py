from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch
from torch.utils.data import DataLoader

from training.data.dataset import (
    TrainClipDataset,
    TrainCollate,
    eval_audio_chunks,
    eval_captions,
)
from training.data.manifest import ClipRecord
from training.objectives.base import BuildEnv, TermConfig
from training.objectives.kcl import OneToK
from training.objectives.random_language import RandomLanguage

LANGS = ("eng", "fra", "deu")


class FakeTokenizer:
    """Word ids by a fixed vocabulary (unknown words → 9); pads with 0 to length 5."""

    pad_id = 0
    vocab = {"a": 3, "dog": 4, "chien": 5, "un": 6, "bell": 7, "hund": 8}

    def encode(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = np.zeros((len(texts), 5), dtype=np.int64)
        mask = np.zeros((len(texts), 5), dtype=np.int64)
        for row, text in enumerate(texts):
            tokens = [self.vocab.get(w, 9) for w in text.lower().split()][:5]
            ids[row, : len(tokens)] = tokens
            mask[row, : len(tokens)] = 1
        return ids, mask


@pytest.fixture()
def records(tmp_path: Path) -> list[ClipRecord]:
    """Three clips: a ramp of 2 s at 8 kHz, 0.5 s and 1 s at 16 kHz; clip 1 lacks French, clip 2 German."""
    specs = [
        ("long", 8000, 2.0, {"eng": ["a dog", "dog"], "fra": ["un chien", "chien"], "deu": ["a hund", "hund"]}),
        ("short", 16000, 0.5, {"eng": ["a bell"], "deu": ["hund"]}),
        ("mid", 16000, 1.0, {"eng": ["dog dog"], "fra": ["un chien"]}),
    ]
    out = []
    for clip_id, rate, seconds, captions in specs:
        path = tmp_path / f"{clip_id}.wav"
        sf.write(path, np.linspace(-0.5, 0.5, int(rate * seconds)), rate, subtype="FLOAT")
        out.append(ClipRecord(clip_id, path, captions, "train", {}))
    return out


def _strategy(cls: type, languages: Sequence[str] = LANGS) -> object:
    return cls(TermConfig(), BuildEnv(languages=tuple(languages), embed_dim=8))


def test_dataset_crops_randomly_per_epoch_and_pads_short_clips(records: list[ClipRecord]) -> None:
    dataset = TrainClipDataset(records, sample_rate=16000, clip_samples=8000, seed=0)
    assert len(dataset) == 3
    item = dataset[0]
    assert item.waveform.shape == (8000,) and item.waveform.dtype == np.float32 and item.index == 0
    assert item.captions is records[0].captions
    np.testing.assert_array_equal(dataset[0].waveform, item.waveform)
    starts = set()
    for epoch in range(6):
        dataset.set_epoch(epoch)
        starts.add(round(float(dataset[0].waveform[0]), 4))
    assert len(starts) > 1
    np.testing.assert_allclose(dataset[1].waveform, np.linspace(-0.5, 0.5, 8000), atol=1e-6)  # exact fit
    padded = TrainClipDataset(records, sample_rate=16000, clip_samples=12000, seed=0)[1].waveform
    np.testing.assert_array_equal(padded[8000:], 0)


def test_collate_one_to_k_shapes_masks_and_padding(records: list[ClipRecord]) -> None:
    dataset = TrainClipDataset(records, sample_rate=16000, clip_samples=4000, seed=0)
    collate = TrainCollate(_strategy(OneToK), FakeTokenizer(), seed=0)
    batch = collate([dataset[i] for i in range(3)])
    assert batch.waveform.shape == (3, 4000) and batch.waveform.dtype == torch.float32
    assert batch.input_ids.shape == (3, 3, 5) and batch.input_ids.dtype == torch.long
    assert batch.attention_mask.shape == (3, 3, 5) and batch.attention_mask.dtype == torch.long
    assert batch.text_mask.dtype == torch.bool
    assert batch.text_mask.tolist() == [[True, True, True], [True, False, True], [True, True, False]]
    assert batch.clip_index.tolist() == [0, 1, 2]
    assert batch.texts[1][1] is None and batch.texts[2][2] is None
    assert batch.texts[0][1] == "a bell" and batch.texts[2][1] == "hund"
    np.testing.assert_array_equal(batch.input_ids[0, 1].numpy(), [3, 7, 0, 0, 0])
    np.testing.assert_array_equal(batch.attention_mask[0, 1].numpy(), [1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch.input_ids[1, 1].numpy(), [0] * 5)  # missing view: padding
    np.testing.assert_array_equal(batch.attention_mask[1, 1].numpy(), [0] * 5)
    group = batch.texts[0][0], batch.texts[1][0], batch.texts[2][0]  # one query group: same position
    assert group in {("a dog", "un chien", "a hund"), ("dog", "chien", "hund")}


def test_collate_is_deterministic_per_clip_and_epoch(records: list[ClipRecord]) -> None:
    dataset = TrainClipDataset(records, sample_rate=16000, clip_samples=4000, seed=0)
    collate = TrainCollate(_strategy(RandomLanguage), FakeTokenizer(), seed=1)
    together = collate([dataset[0], dataset[1], dataset[2]])
    alone = collate([dataset[2]])
    assert together.texts[0][2] == alone.texts[0][0]
    seen = set()
    for epoch in range(12):
        collate.set_epoch(epoch)
        seen.add(collate([dataset[0]]).texts[0][0])
    assert len(seen) > 2  # random language and caption change with the epoch
    collate.set_epoch(3)
    assert collate([dataset[0]]).texts == collate([dataset[0]]).texts


def test_loader_batches_do_not_depend_on_worker_count(records: list[ClipRecord]) -> None:
    def batches(workers: int) -> list:
        dataset = TrainClipDataset(records, sample_rate=16000, clip_samples=4000, seed=7)
        collate = TrainCollate(_strategy(RandomLanguage), FakeTokenizer(), seed=7)
        dataset.set_epoch(2)
        collate.set_epoch(2)
        loader = DataLoader(dataset, batch_size=2, collate_fn=collate, num_workers=workers)
        return [(b.waveform, b.texts, b.clip_index) for b in loader]

    for (wave_a, texts_a, index_a), (wave_b, texts_b, index_b) in zip(batches(0), batches(2), strict=True):
        torch.testing.assert_close(wave_a, wave_b)
        assert texts_a == texts_b and index_a.tolist() == index_b.tolist()


def test_batch_to_device_keeps_texts(records: list[ClipRecord]) -> None:
    dataset = TrainClipDataset(records, sample_rate=16000, clip_samples=4000, seed=0)
    batch = TrainCollate(_strategy(OneToK), FakeTokenizer(), seed=0)([dataset[0], dataset[1]])
    moved = batch.to("cpu")
    assert moved.texts is batch.texts and torch.equal(moved.input_ids, batch.input_ids)


def test_eval_captions_groups_translations(records: list[ClipRecord]) -> None:
    captions = eval_captions(records, ["eng", "fra"])
    assert captions.texts == ["a dog", "un chien", "dog", "chien", "a bell", "dog dog", "un chien"]
    assert captions.clip.tolist() == [0, 0, 0, 0, 1, 2, 2]
    assert captions.lang.tolist() == ["eng", "fra", "eng", "fra", "eng", "eng", "fra"]
    assert captions.group.tolist() == [0, 0, 1, 1, 2, 3, 3]
    assert captions.clip.dtype == np.int64 and captions.group.dtype == np.int64


def test_eval_audio_chunks_policies(records: list[ClipRecord]) -> None:
    chunks = eval_audio_chunks(records[0], sample_rate=16000, clip_samples=12000, policy="chunk")
    ramp = np.linspace(-0.5, 0.5, 32000)  # the 2 s ramp at 16 kHz (resampler edges aside)
    assert chunks.shape == (3, 12000)
    for chunk, start in zip(chunks, (0, 12000, 20000), strict=True):  # last chunk right-aligned
        np.testing.assert_allclose(chunk[200:-200], ramp[start + 200 : start + 11800], atol=0.01)
    center = eval_audio_chunks(records[0], sample_rate=16000, clip_samples=12000, policy="center")
    assert center.shape == (1, 12000) and center[0, 6000] == pytest.approx(0.0, abs=0.01)
    short = eval_audio_chunks(records[1], sample_rate=16000, clip_samples=12000, policy="chunk")
    assert short.shape == (1, 12000)
    np.testing.assert_array_equal(short[0, 8000:], 0)
