"""Distillation teachers at scale (SPEC §13): host caches bounded in bytes with a hit rate, and
teachers run under the student's autocast."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import TINY_CONFIG
from training.config import load_train_config
from training.teachers import HostCache, build_teachers


def test_host_cache_drops_the_least_recently_used_rows_past_its_budget() -> None:
    cache = HostCache(max_bytes=3 * 2 * 4 * 4)  # three (2, 4) float32 rows
    for key in range(3):
        cache.put(key, torch.full((2, 4), float(key)))
    assert cache.lookup(0) is not None  # 0 is now the most recently used
    cache.put(3, torch.ones(2, 4))
    assert 1 not in cache and {0, 2, 3} <= set(cache.keys())  # 1 was the least recently used
    assert cache.bytes <= cache.max_bytes and cache.lookup(1) is None
    stats = cache.stats()
    assert stats["entries"] == 3 and stats["hit_rate"] == pytest.approx(0.5)  # 1 hit, 1 miss
    row = cache.lookup(3)
    assert row is not None and row.device.type == "cpu" and row.dtype == torch.float32


def _teachers(checkpoint: Path, manifest: Path, **kwargs: object):  # type: ignore[no-untyped-def]
    cfg = load_train_config(TINY_CONFIG, [f"data.manifest={manifest}"])
    return build_teachers({"teachers": [str(checkpoint)], "cache": "on", **kwargs}, device="cpu",
                          train_records=[], tokenizer=None, frontend=cfg.frontend, data=cfg.data,
                          )


def test_teacher_caches_count_hits_and_stay_in_their_budget(tiny_checkpoint: Path, tiny_corpus: Path) -> None:
    teachers = _teachers(tiny_checkpoint, tiny_corpus, cache_max_mib=0.001)  # ~1 KiB: a few rows
    waveform = 0.1 * torch.randn(4, 16_000, generator=torch.Generator().manual_seed(0))
    batch = SimpleNamespace(waveform=waveform, clip_index=torch.arange(4), texts=[["a dog", "rain", None, "a dog"]])
    first_audio, first_text = teachers.embed(batch)
    again_audio, again_text = teachers.embed(batch)
    stats = teachers.cache_stats()
    assert stats["teacher_text_cache_mib"] <= 0.001 and stats["teacher_audio_cache_mib"] <= 0.001
    assert 0 < stats["teacher_audio_cache_hit_rate"] < 1  # some rows were evicted and re-embedded
    torch.testing.assert_close(again_audio, first_audio)  # evicted or not, the same embeddings
    torch.testing.assert_close(again_text, first_text)
    roomy = _teachers(tiny_checkpoint, tiny_corpus)
    roomy.embed(batch), roomy.embed(batch)
    assert roomy.cache_stats()["teacher_audio_cache_hit_rate"] == pytest.approx(0.5)  # 4 misses, 4 hits


def test_teachers_run_under_the_students_autocast(tiny_checkpoint: Path, tiny_corpus: Path) -> None:
    cfg = load_train_config(TINY_CONFIG, [f"data.manifest={tiny_corpus}"])
    entered = []

    def bf16():  # type: ignore[no-untyped-def]
        entered.append(True)
        return torch.autocast("cpu", dtype=torch.bfloat16)

    spec = {"teachers": [str(tiny_checkpoint)], "cache": "off"}
    plain = build_teachers(spec, device="cpu", train_records=[], tokenizer=None, frontend=cfg.frontend, data=cfg.data)
    mixed = build_teachers(spec, device="cpu", train_records=[], tokenizer=None, frontend=cfg.frontend, data=cfg.data,
                           autocast=bf16)
    batch = SimpleNamespace(waveform=0.1 * torch.randn(2, 16_000, generator=torch.Generator().manual_seed(1)),
                            clip_index=torch.arange(2), texts=[["a dog", "rain"]])
    audio32, text32 = plain.embed(batch)
    audio16, text16 = mixed.embed(batch)
    assert entered and audio16.dtype == torch.float32 and text16.dtype == torch.float32
    assert not torch.equal(audio16, audio32)  # bf16 matmuls ran ...
    torch.testing.assert_close(audio16, audio32, atol=0.05, rtol=0.05)  # ... and agree to bf16 precision
