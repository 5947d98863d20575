"""index/items/embeddings.py: item embeddings kept on disk per bundle (issue 55, part 2)."""

from __future__ import annotations

import numpy as np

from index.items.embeddings import EMBEDDINGS_DIR, EmbeddingStore, bundle_key, prune


def test_entries_round_trip_and_a_wrong_sized_file_is_never_trusted(tmp_path):
    store = EmbeddingStore(tmp_path, "b1", 4, encoder_sha256="ab" * 32)
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4)
    vectors[2, 0] = np.nan  # a failed embedding is not stored
    assert store.put(["x.wav", "y.wav", "z.wav"], vectors, [10, 20, 30]) == 2
    found, got, sizes = store.get(["x.wav", None, "y.wav", "z.wav", "w.wav"])
    assert found.tolist() == [True, False, True, False, False]
    np.testing.assert_array_equal(got[[0, 2]], vectors[:2])
    assert sizes.tolist() == [10, -1, 20, -1, -1]
    store._path("x.wav").write_bytes(b"\0" * 7)  # torn
    assert store.get(["x.wav"])[0].tolist() == [False]
    # another dimension or encoder reads nothing of this one
    assert not EmbeddingStore(tmp_path, "b1", 8, encoder_sha256="ab" * 32).get(["y.wav"])[0].any()
    assert not EmbeddingStore(tmp_path, "b1", 4, encoder_sha256="cd" * 32).get(["y.wav"])[0].any()
    assert bundle_key("a/b", 4) == "a_b-4"


def test_prune_keeps_only_live_audio_of_every_bundle(tmp_path):
    for bundle in ("b1", "b2"):
        EmbeddingStore(tmp_path, bundle, 2).put(["live.wav", "dead.wav"], np.ones((2, 2), np.float32), [1, 1])
    assert prune(tmp_path, {"live.wav"}) == 2
    left = sorted(p.name for p in (tmp_path / EMBEDDINGS_DIR).rglob("*.f32"))
    assert left == ["live.wav.f32", "live.wav.f32"]
    assert prune(tmp_path, set()) == 2 and not any((tmp_path / EMBEDDINGS_DIR).iterdir())


def test_windows_entries_round_trip_beside_the_vector_and_a_torn_one_is_never_trusted(tmp_path):
    """Issue 54 part 4: an item's moment windows are kept with its clip vector (none is an entry too)."""
    store = EmbeddingStore(tmp_path, "b1", 4)
    spans = np.array([[0.0, 1.0], [0.5, 1.5], [1.0, 2.0]])
    vectors = np.arange(12, dtype=np.float32).reshape(3, 4)
    assert store.put_windows("long.wav", spans, vectors, 1234)
    assert store.put_windows("short.wav", np.zeros((0, 2)), np.zeros((0, 0), np.float32), 56)
    long, short, absent, nothing = store.get_windows(["long.wav", "short.wav", "absent.wav", None])
    assert long is not None and long[0] == 1234
    np.testing.assert_array_equal(long[1], spans)
    np.testing.assert_array_equal(long[2], vectors)
    assert short is not None and short[0] == 56 and short[1].shape == (0, 2) and short[2].shape == (0, 4)
    assert absent is None and nothing is None
    assert not store.put_windows("odd.wav", spans, np.ones((3, 5), np.float32), 1)  # another dimension
    entry = store._path("long.wav", ".win")
    entry.write_bytes(entry.read_bytes()[:-4])  # torn
    assert store.get_windows(["long.wav"]) == [None]
    assert EmbeddingStore(tmp_path, "b1", 8).get_windows(["short.wav"]) == [None]  # another dimension's reader


def test_prune_removes_the_windows_with_the_vectors(tmp_path):
    store = EmbeddingStore(tmp_path, "b1", 2)
    for name in ("live.wav", "dead.wav"):
        store.put([name], np.ones((1, 2), np.float32), [1])
        store.put_windows(name, np.zeros((1, 2)), np.ones((1, 2), np.float32), 1)
    assert prune(tmp_path, {"live.wav"}) == 2
    left = sorted(p.name for p in (tmp_path / EMBEDDINGS_DIR).rglob("*.*"))
    assert left == ["live.wav.f32", "live.wav.win"]
