"""Extra passes stream (SPEC §13): knowledge-base, pair and validation embedding decode clips in
batches with loader workers, keep only embeddings, survive a bad file, and split ranks by cost."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import soundfile as sf
import torch
from torch import nn

from training.config import DataConfig, FrontendConfig
from training.data.manifest import ClipRecord
from training.distributed import balanced_assignment
from training.evaluate import StreamStats, embed_chunks, embed_clips, load_clip_chunks


class MeanAndEnergy(nn.Module):
    """A deterministic 'encoder': (mean, rms, first sample) of each window (eval mode needs no weights)."""

    embed_dim = 3

    def encode_audio(self, waveform: torch.Tensor) -> torch.Tensor:
        return torch.stack([waveform.mean(1), waveform.pow(2).mean(1).sqrt(), waveform[:, 0]], dim=1)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[ClipRecord]:
    """9 FLAC clips of 0.4 to 7 s at 22.05 kHz (resampled to 16 kHz), one corrupt file among them."""
    folder = tmp_path_factory.mktemp("passes")
    rng = np.random.default_rng(0)
    records = []
    for i, seconds in enumerate([0.4, 1.0, 2.5, 3.0, 7.0, 1.5, 4.2, 0.9, 5.5]):
        path = folder / f"clip{i}.flac"
        sf.write(path, (0.3 * rng.standard_normal(int(22050 * seconds))).astype(np.float32), 22050)
        records.append(ClipRecord(id=f"c{i}", audio=path, captions={"eng": [f"clip {i}"]}, split="train"))
    records[5].audio.write_bytes(b"fLaC" + bytes(200))  # corrupt
    return records


@pytest.mark.parametrize("policy", ["center", "chunk"])
@pytest.mark.parametrize("workers", [0, 2])
def test_streamed_embeddings_equal_decoding_everything_first(
    corpus: list[ClipRecord], policy: str, workers: int, caplog: pytest.LogCaptureFixture
) -> None:
    data = DataConfig(clip_seconds=2.0, eval_crop=policy)  # type: ignore[arg-type]
    front = FrontendConfig()
    good = [r for i, r in enumerate(corpus) if i != 5]
    reference = embed_chunks(MeanAndEnergy(), load_clip_chunks(good, data_cfg=data, frontend_cfg=front),
                             batch_size=4, device=torch.device("cpu"))
    stats = StreamStats()
    with caplog.at_level(logging.WARNING):
        streamed = embed_clips(MeanAndEnergy(), corpus, data_cfg=data, frontend_cfg=front, batch_size=3,
                               device=torch.device("cpu"), num_workers=workers, stats=stats)
    assert streamed.shape == (9, 3)
    torch.testing.assert_close(torch.cat([streamed[:5], streamed[6:]]), reference, rtol=0, atol=1e-6)
    assert torch.all(streamed[5] == 0)  # the corrupt clip embeds as zeros ...
    assert stats.clips == 9 and len(stats.failed) == 1 and "clip5.flac" in stats.failed[0]
    assert "1 of 9 clips could not be decoded" in caplog.text and "clip5.flac" in caplog.text  # ... and is named


def test_balanced_assignment_splits_by_cost_not_count() -> None:
    costs = [6, 6, 1, 1, 1, 1, 1, 1, 1, 1]  # two long clips (chunk-and-average windows) among short ones
    parts = balanced_assignment(costs, 2)
    assert sorted(i for part in parts for i in part) == list(range(10))
    loads = [sum(costs[i] for i in part) for part in parts]
    assert loads == [10, 10]
    assert (0 in parts[0]) != (1 in parts[0])  # the long clips go to different ranks
    assert balanced_assignment(costs, 2) == parts  # every rank computes the same split
    contiguous = [sum(costs[:5]), sum(costs[5:])]
    assert max(contiguous) > max(loads)  # what shard_range's contiguous halves would have given


def test_balanced_assignment_with_more_parts_than_items() -> None:
    assert balanced_assignment([3.0, 1.0], 4) == [[0], [1], [], []]


def test_window_budget_batches_keep_order_and_bound_each_batch() -> None:
    from training.evaluate import window_batches

    windows = [1, 12, 3, 3, 1, 20, 2]
    batches = window_batches(windows, 8)
    assert [i for batch in batches for i in batch] == list(range(7))
    assert batches == [[0], [1], [2, 3, 4], [5], [6]]  # a clip over the budget goes alone


def test_streaming_with_a_window_budget_gives_the_same_embeddings(corpus: list[ClipRecord]) -> None:
    data, front = DataConfig(clip_seconds=1.0, eval_crop="chunk"), FrontendConfig()
    plain = embed_clips(MeanAndEnergy(), corpus, data_cfg=data, frontend_cfg=front, batch_size=4,
                        device=torch.device("cpu"))
    windows = [max(1, -(-int(sf.info(str(r.audio)).frames) // 22050)) if i != 5 else 1 for i, r in enumerate(corpus)]
    budgeted = embed_clips(MeanAndEnergy(), corpus, data_cfg=data, frontend_cfg=front, batch_size=4,
                           device=torch.device("cpu"), windows=windows)
    torch.testing.assert_close(budgeted, plain, rtol=0, atol=1e-6)
