"""Serving at real size: micro-batches padded to their longest text, and the encoders' ONNX Runtime options."""

from __future__ import annotations

import faiss
import numpy as np
import pytest

from index.runtime.loader import LoadedBundle, SessionConfig, encode_texts
from service.bundles import default_opener, session_config
from service.settings import Settings

TEXTS = [
    "a dog",
    "rain falls",
    "犬が吠える",
    "une sirène",
]


@pytest.fixture(scope="module")
def bundle(tiny_bundle):
    return LoadedBundle.open(tiny_bundle, intra_op_threads=1, verify=False)


def test_pad_to_longest_cuts_only_unused_columns(bundle):
    tokenizer = bundle.tokenizer
    full_ids, full_mask = tokenizer.encode(TEXTS)
    ids, mask = tokenizer.encode(TEXTS, pad_to_longest=True)
    longest = int(full_mask.sum(axis=1).max())
    assert full_ids.shape[1] == tokenizer.max_length
    assert ids.shape == mask.shape == (len(TEXTS), longest) and longest < tokenizer.max_length
    np.testing.assert_array_equal(ids, full_ids[:, :longest])
    np.testing.assert_array_equal(mask, full_mask[:, :longest])
    assert not full_mask[:, longest:].any()  # what was cut was padding only
    short_ids, _ = tokenizer.encode(TEXTS[:1], pad_to_longest=True)
    assert short_ids.shape[1] == int(full_mask[0].sum())


def test_batched_padded_embeddings_match_each_text_alone(bundle):
    encoder, tokenizer, dim = bundle._text_encoder, bundle.tokenizer, bundle.embed_dim
    batched = encode_texts(encoder, tokenizer, TEXTS, embed_dim=dim)
    full_width = encode_texts(encoder, tokenizer, TEXTS, embed_dim=dim, pad_to_longest=False)
    alone = np.concatenate([encode_texts(encoder, tokenizer, [t], embed_dim=dim) for t in TEXTS])
    np.testing.assert_allclose(batched, alone, atol=1e-5)
    np.testing.assert_allclose(batched, full_width, atol=1e-5)
    assert np.abs(batched[0] - batched[1]).max() > 1e-3  # different texts, different embeddings


def test_session_config_sets_the_ort_options():
    options = SessionConfig(threads=3, optimization="basic", spinning=False).options()
    assert options.intra_op_num_threads == 3 and options.inter_op_num_threads == 1
    assert str(options.graph_optimization_level).endswith("ORT_ENABLE_BASIC")
    assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    spinning = SessionConfig(threads=None, optimization="all", spinning=True).options()
    assert spinning.intra_op_num_threads == 0  # ORT default: one per core
    assert str(spinning.graph_optimization_level).endswith("ORT_ENABLE_ALL")
    assert spinning.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert options.enable_cpu_mem_arena  # ORT's default for bulk embedding
    assert not SessionConfig(memory_arena=False).options().enable_cpu_mem_arena


def test_service_settings_reach_the_loaded_sessions(tiny_bundle, monkeypatch):
    monkeypatch.setenv("TONEARM_ONNX_THREADS", "2")
    monkeypatch.setenv("TONEARM_ONNX_GRAPH_OPTIMIZATION", "extended")
    monkeypatch.setenv("TONEARM_FAISS_THREADS", "1")
    settings = Settings()
    assert session_config(settings) == SessionConfig(threads=2, optimization="extended", spinning=False,
                                                     memory_arena=False)
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(2)
    try:
        opened = default_opener(settings)(tiny_bundle)
        assert faiss.omp_get_max_threads() == 1
    finally:
        faiss.omp_set_num_threads(before)
    for encoder in (opened._text_encoder, opened._audio_encoder):  # type: ignore[attr-defined]
        options = encoder.session.get_session_options()
        assert options.intra_op_num_threads == 2
        assert str(options.graph_optimization_level).endswith("ORT_ENABLE_EXTENDED")
        assert options.get_session_config_entry("session.intra_op.allow_spinning") == "0"
        assert not options.enable_cpu_mem_arena  # the service's default (the soak's memory, docs/service.md)
    opened.close()
    monkeypatch.setenv("TONEARM_ONNX_MEMORY_ARENA", "true")
    assert session_config(Settings()).memory_arena
