"""`LoadedBundle`: encoders, language-filtered search, concurrency, memory-mapping, lifecycle."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import faiss
import numpy as np
import pytest

from index.audio.decode import eval_chunks
from index.runtime.loader import LoadedBundle
from tonearm.errors import BundleError


@pytest.fixture(scope="module")
def bundle(tiny_bundle):
    return LoadedBundle.open(tiny_bundle, device="auto", intra_op_threads=1)


@pytest.fixture(scope="module")
def caption_vectors(bundle) -> np.ndarray:
    """The stored caption embeddings (exact Flat index: reconstructable)."""
    index = bundle._text_index.index
    return faiss.rev_swig_ptr(faiss.downcast_index(index).get_xb(), index.ntotal * index.d).reshape(
        index.ntotal, index.d
    ).copy()


def test_attributes_follow_the_manifest(bundle, tiny_bundle):
    m = bundle.manifest
    assert bundle.path == tiny_bundle and bundle.bundle_id == tiny_bundle.name
    assert bundle.languages == ["eng", "fra", "deu", "spa", "nld", "cat", "jpn", "zho"]
    assert bundle.embed_dim == m.embed_dim == 32
    assert bundle.clip_samples == round(m.clip_seconds * m.sample_rate) == 32000
    assert len(bundle.audio_items) == m.audio_index.ntotal
    assert set(bundle.audio_items[0]) == {"id", "uri", "captions", "split", "metadata"}
    assert set(bundle.text_items[0]) == {"clip_id", "clip_row", "lang", "text"}


def test_clips_carry_their_manifest_metadata_and_filtered_search_is_exact(bundle):
    """The export writes each clip's split and filterable metadata; a filtered search over the
    bundle's Flat index equals numpy over the passing clips (picked here in plain Python)."""
    from index.engines.filters import MetadataTable, parse_filter

    item = bundle.audio_items[0]
    assert item["split"] in ("train", "val", "test") and isinstance(item["metadata"]["duration"], float)
    assert "events" not in item["metadata"]  # a list of objects is not filterable
    flt = {"duration": {"lte": 3.0}, "relation": {"ne": "repeat"}}
    allowed = np.array([i["metadata"]["duration"] <= 3.0 and i["metadata"]["relation"] != "repeat"
                        for i in bundle.audio_items])
    assert 0 < allowed.sum() < len(allowed)
    np.testing.assert_array_equal(MetadataTable.from_items(bundle.audio_items).mask(parse_filter(flt)), allowed)
    queries = bundle.encode_text(["a dog barks", "rain"])
    scores, rows = bundle.search_audio(queries, 5, allowed=allowed)
    vectors = bundle.audio_embeddings()
    for i in range(2):
        passing = np.flatnonzero(allowed)
        ref = np.sort(vectors[passing] @ queries[i])[::-1][: min(5, passing.size)]
        np.testing.assert_allclose(scores[i, : ref.size], ref, atol=1e-5)
        assert allowed[rows[i, : ref.size]].all()


def test_encoders_return_unit_vectors(bundle):
    text = bundle.encode_text(["a dog barks", "", "雨が降る"])
    audio = bundle.encode_audio([np.zeros(100, np.float32), 0.1 * np.ones(50_000, np.float32)])
    for emb, n in ((text, 3), (audio, 2)):
        assert emb.shape == (n, 32) and emb.dtype == np.float32
        np.testing.assert_allclose(np.linalg.norm(emb, axis=1), 1.0, atol=1e-5)
    assert bundle.encode_text([]).shape == (0, 32) and bundle.encode_audio([]).shape == (0, 32)
    with pytest.raises(TypeError):
        bundle.encode_text("not a list")


def test_long_audio_is_the_normalized_mean_of_its_chunks(bundle):
    wave = bundle.eval_set().waveforms[0]
    long = np.concatenate([wave, wave[::-1], wave[: len(wave) // 3]])
    chunks = eval_chunks(long, bundle.clip_samples)
    assert len(chunks) >= 3
    per_chunk = bundle.encode_audio(list(chunks))  # each exactly clip_samples long: one chunk each
    mean = per_chunk.mean(axis=0)
    np.testing.assert_allclose(bundle.encode_audio([long])[0], mean / np.linalg.norm(mean), atol=1e-5)


def test_indexed_clips_are_the_encoded_catalogue(bundle):
    held_out = bundle.eval_set()
    rows = {item["id"]: i for i, item in enumerate(bundle.audio_items)}
    queries = bundle.encode_audio(held_out.waveforms[:3])
    scores, found = bundle.search_audio(queries, 1)
    assert [bundle.audio_items[r]["id"] for r in found[:, 0]] == held_out.clip_ids[:3]
    assert [rows[c] for c in held_out.clip_ids[:3]] == found[:, 0].tolist()
    np.testing.assert_allclose(scores[:, 0], 1.0, atol=1e-4)  # same clip, same embedding


@pytest.mark.parametrize("languages", [["fra"], ["jpn", "eng"], ["zho", "cat", "deu"]])
def test_language_filter_equals_brute_force_over_those_captions(bundle, caption_vectors, languages):
    queries = bundle.encode_text(["rain falls", "sirène", "鳥が鳴く"])
    scores, rows = bundle.search_text(queries, 7, languages=languages)
    keep = np.array([t["lang"] in languages for t in bundle.text_items])
    allowed = np.flatnonzero(keep)
    brute = queries @ caption_vectors[allowed].T
    expected = -np.sort(-brute, axis=1)[:, :7]
    np.testing.assert_allclose(scores, expected, atol=1e-5)
    assert keep[rows].all()


def test_no_filter_and_all_languages_search_everything(bundle, caption_vectors):
    queries = bundle.encode_text(["engine hum"])
    full = bundle.search_text(queries, 5)
    np.testing.assert_array_equal(full[1], bundle.search_text(queries, 5, languages=bundle.languages)[1])
    np.testing.assert_allclose(full[0][0], -np.sort(-(queries @ caption_vectors.T)[0])[:5], atol=1e-5)


def test_unknown_language_and_bad_k(bundle):
    q = bundle.encode_text(["x"])
    with pytest.raises(ValueError, match="xxx"):
        bundle.search_text(q, 3, languages=["xxx"])
    with pytest.raises(ValueError, match="k must be"):
        bundle.search_audio(q, 0)


def test_k_beyond_the_catalogue_pads_with_minus_one(bundle):
    n = len(bundle.audio_items)
    scores, rows = bundle.search_audio(bundle.encode_text(["wind"]), n + 5)
    assert sorted(rows[0, :n].tolist()) == list(range(n))
    assert (rows[0, n:] == -1).all() and np.isneginf(scores[0, n:]).all()


def test_concurrent_searches_match_sequential(bundle):
    queries = bundle.encode_text([f"{w} {i}" for i in range(6) for w in ("bell", "dog", "rain")])
    filters = [None, ["fra"], ["jpn", "eng"], ["deu"]]

    def job(i: int):
        q = queries[i % len(queries)][None, :]
        if i % 5 == 0:
            return bundle.search_audio(q, 4)
        return bundle.search_text(q, 4, languages=filters[i % 4])

    sequential = [job(i) for i in range(60)]
    with ThreadPoolExecutor(max_workers=6) as pool:
        concurrent = list(pool.map(job, range(60)))
    for (s_scores, s_rows), (c_scores, c_rows) in zip(sequential, concurrent, strict=True):
        np.testing.assert_array_equal(s_rows, c_rows)
        np.testing.assert_allclose(s_scores, c_scores, atol=1e-6)


def test_memory_mapped_open_gives_the_same_results(bundle, tiny_bundle):
    mapped = LoadedBundle.open(tiny_bundle, verify=False, mmap_threshold_bytes=0)
    q = bundle.encode_text(["a bell rings twice", "le vent souffle"])
    np.testing.assert_array_equal(mapped.search_audio(q, 5)[1], bundle.search_audio(q, 5)[1])
    np.testing.assert_array_equal(
        mapped.search_text(q, 5, languages=["fra"])[1], bundle.search_text(q, 5, languages=["fra"])[1]
    )
    mapped.close()


def test_eval_set_and_warmup_and_close(tiny_bundle):
    own = LoadedBundle.open(tiny_bundle, verify=False)
    held_out = own.eval_set()
    m = own.manifest.eval_set
    assert len(held_out.waveforms) == len(held_out.clip_ids) == m.n_clips
    assert len(held_out.captions) == len(held_out.clip) == len(held_out.lang) == len(held_out.group) == m.n_captions
    assert set(held_out.lang.tolist()) == set(own.languages)
    assert all(w.dtype == np.float32 and np.abs(w).max() <= 1.0 for w in held_out.waveforms)
    own.warmup()
    own.close()
    with pytest.raises(BundleError, match="closed"):
        own.encode_text(["x"])
    with pytest.raises(BundleError, match="closed"):
        own.search_audio(np.zeros((1, 32), np.float32), 1)


def test_inconsistent_ids_are_refused_even_with_valid_checksums(tiny_bundle, tmp_path):
    """A re-checksummed bundle whose caption row names the wrong clip fails at open, naming the line."""
    import json
    import shutil

    from index.bundle import format as fmt

    manifest = fmt.read_manifest(tiny_bundle)
    with fmt.staged_bundle(tmp_path, "bad-ids") as staging:
        for rel in manifest.files:
            (staging / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(tiny_bundle / rel, staging / rel)
        lines = (staging / "text_ids.jsonl").read_text().splitlines()
        row = json.loads(lines[4])
        row["clip_row"] = (row["clip_row"] + 1) % manifest.audio_index.ntotal
        lines[4] = json.dumps(row)
        (staging / "text_ids.jsonl").write_text("\n".join(lines) + "\n")
        path = fmt.publish(staging, manifest.model_copy(update={"bundle_id": "bad-ids"}))
    with pytest.raises(BundleError, match=r"text_ids.jsonl:5:"):
        LoadedBundle.open(path)


def test_audio_embeddings_are_the_indexed_clip_vectors(bundle):
    vectors = bundle.audio_embeddings()
    assert vectors.shape == (len(bundle.audio_items), bundle.embed_dim)
    held_out = bundle.eval_set()
    rows = {item["id"]: i for i, item in enumerate(bundle.audio_items)}
    encoded = bundle.encode_audio(held_out.waveforms[:3])
    stored = vectors[[rows[c] for c in held_out.clip_ids[:3]]]
    np.testing.assert_allclose(stored, encoded, atol=1e-4)


def test_audio_embeddings_read_back_from_an_ivf_index_without_touching_it():
    from index.engines.faiss_index import build_index
    from index.runtime.loader import FaissVectorIndex

    rng = np.random.default_rng(0)
    vectors = rng.standard_normal((400, 16)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    index = build_index(vectors, "IVF4,Flat").index
    holder = LoadedBundle.__new__(LoadedBundle)
    holder._audio_index = FaissVectorIndex(index, {"nprobe": 2})
    np.testing.assert_allclose(holder.audio_embeddings(), vectors, atol=1e-6)
    assert not faiss.extract_index_ivf(index).direct_map.type  # serving index unchanged
