"""A bundle of the demo's size (3,000 clips, 120,000 captions in the tiny bundle's languages), built in
seconds: the tiny bundle's encoders, tokenizer and held-out set with random unit vectors as its indices
(exact ``Flat``), so publishing it to the real Milvus server costs what publishing the demo does.

One per test session (``large_bundle`` fixture in tests/conftest.py), shared by the Milvus tests that
need realistic sizes (publish, slow-versus-dead). Treat it as read-only.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np

N_AUDIO = 3_000
N_TEXT = 120_000
"""The demo bundle's sizes (issue 33: ≥ 100 k caption vectors)."""


def unit_vectors(n: int, d: int, seed: int) -> np.ndarray:
    vectors = np.random.default_rng(seed).standard_normal((n, d), dtype=np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")


def build_large_bundle(tiny_bundle: Path, parent: Path, *, n_audio: int = N_AUDIO, n_text: int = N_TEXT,
                       bundle_id: str = "large-random", seed: int = 0, dim: int | None = None) -> Path:
    """``tiny_bundle``'s encoders and held-out set with ``n_audio`` clip and ``n_text`` caption vectors
    (random, unit length; captions grouped by language, caption ``r`` of a language describing clip
    ``r mod n_audio``) in exact Flat indices.

    ``dim``: vectors of another dimension than the encoders' (the demo's 256), for a bundle that is
    only published (bench/milvus_publish.py): its encoders no longer match, so it cannot be served."""
    import faiss

    from index.bundle import format as fmt

    manifest = fmt.read_manifest(tiny_bundle)
    assert manifest.text_index is not None
    d, languages = dim or manifest.embed_dim, list(manifest.languages)
    audio_info, text_info = manifest.audio_index, manifest.text_index
    replaced = {audio_info.file, audio_info.ids_file, text_info.file, text_info.ids_file}
    with fmt.staged_bundle(parent, bundle_id) as staging:
        for rel in manifest.files:
            if rel not in replaced:
                (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(tiny_bundle / rel, staging / rel)
        clips = [{"id": f"clip{i:05d}", "uri": f"clips/clip{i:05d}.flac", "captions": {}} for i in range(n_audio)]
        per_lang = -(-n_text // len(languages))
        captions, ranges = [], {}
        for lang in languages:
            start = len(captions)
            for j in range(min(per_lang, n_text - start)):
                clip = j % n_audio
                captions.append({"clip_id": clips[clip]["id"], "clip_row": clip, "lang": lang,
                                 "text": f"{lang} caption {j} of clip {clip}"})
            ranges[lang] = (start, len(captions))
        for lang in languages:  # each clip's first caption per language, as the export writes them
            lo, hi = ranges[lang]
            for caption in captions[lo : min(hi, lo + n_audio)]:
                clips[caption["clip_row"]]["captions"].setdefault(lang, caption["text"])
        _write_jsonl(staging / audio_info.ids_file, clips)
        _write_jsonl(staging / text_info.ids_file, captions)
        infos = {}
        for name, info, n, seed_k in (("audio", audio_info, n_audio, seed), ("text", text_info, n_text, seed + 1)):
            index = faiss.IndexFlatIP(d)
            index.add(unit_vectors(n, d, seed_k))
            faiss.write_index(index, str(staging / info.file))
            infos[name] = info.model_copy(update={"factory": "Flat", "ntotal": n, "search_params": {}, "dim": d,
                                                  "ann_recall_at_10": 1.0,
                                                  "language_ranges": ranges if name == "text" else None})
        return fmt.publish(staging, manifest.model_copy(update={
            "bundle_id": bundle_id, "audio_index": infos["audio"], "text_index": infos["text"], "embed_dim": d,
        }))
