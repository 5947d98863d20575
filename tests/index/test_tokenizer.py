"""Tokenizer: the torch-free TextTokenizer reproduces the training tokenizer exactly."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from index.bundle.tokenizer import TextTokenizer
from tonearm.errors import TonearmError
from training.config import ModelConfig, TextTowerConfig
from training.models.tokenizer import build_tokenizer, train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[2]

CAPTIONS: dict[str, list[str]] = {
    "eng": ["A dog barks while a bell rings", "Rain falls, then a siren passes far away"],
    "fra": [
        "Un chien aboie pendant qu'une cloche sonne",
        "La pluie tombe, puis une sirène passe au loin",
    ],
    "deu": [
        "Ein Hund bellt, während eine Glocke läutet",
        "Regen fällt, dann fährt eine Sirene weit weg vorbei",
    ],
    "spa": [
        "Un perro ladra mientras suena una campana",
        "Cae la lluvia y luego pasa una sirena a lo lejos",
    ],
    "nld": [
        "Een hond blaft terwijl een bel rinkelt",
        "Regen valt, daarna rijdt een sirene ver weg voorbij",
    ],
    "cat": [
        "Un gos borda mentre sona una campana",
        "Cau la pluja i després passa una sirena lluny",
    ],
    "jpn": ["ベルが鳴る間に犬が吠える", "雨が降り、その後遠くでサイレンが通り過ぎる"],
    "zho": ["铃声响起时狗在叫", "下雨了，然后远处有警笛经过"],
}
ALL_CAPTIONS = [text for texts in CAPTIONS.values() for text in texts]


def corpus() -> list[str]:
    """Training texts: every caption many times (BPE merges need frequency ≥ 2)."""
    return ALL_CAPTIONS * 5


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return train_bpe_tokenizer(corpus(), vocab_size=600, max_length=16)


def test_encode_shapes_and_special_tokens(tokenizer: TextTokenizer) -> None:
    ids, mask = tokenizer.encode(["a dog barks", ""])
    assert ids.dtype == np.int64 and mask.dtype == np.int64
    assert ids.shape == mask.shape == (2, 16)
    backend = tokenizer.backend
    bos, eos, pad = (backend.token_to_id(t) for t in ("<s>", "</s>", "<pad>"))
    assert pad == tokenizer.pad_id == 0
    n = int(mask[0].sum())
    assert ids[0, 0] == bos and ids[0, n - 1] == eos
    assert np.all(ids[0, n:] == pad) and np.all(mask[0, n:] == 0)
    # an empty caption still has <s> </s>
    assert ids[1, :2].tolist() == [bos, eos] and int(mask[1].sum()) == 2


def test_long_captions_are_truncated_to_max_length(tokenizer: TextTokenizer) -> None:
    long = " ".join(ALL_CAPTIONS)
    ids, mask = tokenizer.encode([long])
    assert ids.shape == (1, 16) and int(mask.sum()) == 16
    assert ids[0, -1] == tokenizer.backend.token_to_id("</s>")


def test_normalisation_lowercases(tokenizer: TextTokenizer) -> None:
    a, _ = tokenizer.encode(["A DOG barks "])
    b, _ = tokenizer.encode(["a dog barks"])
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("lang", ["jpn", "zho"])
def test_cjk_tokenizes_sensibly(tokenizer: TextTokenizer, lang: str) -> None:
    text = CAPTIONS[lang][0]
    ids, mask = tokenizer.encode([text])
    n = int(mask.sum())
    # learned merges: fewer tokens than UTF-8 bytes (3 per CJK character), lossless decode
    assert n - 2 < len(text.encode("utf-8")) / 2
    assert tokenizer.backend.decode(ids[0, :n].tolist()).strip() == text


def test_file_round_trip_reproduces_training_tokenization(
    tokenizer: TextTokenizer, tmp_path: Path
) -> None:
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    loaded = TextTokenizer.from_file(path)
    assert loaded.max_length == 16 and loaded.vocab_size == tokenizer.vocab_size
    texts = ALL_CAPTIONS + ["unseen words: xylophone 木琴", " ".join(ALL_CAPTIONS)]
    for got, expected in zip(loaded.encode(texts), tokenizer.encode(texts), strict=True):
        np.testing.assert_array_equal(got, expected)


def test_loading_does_not_import_torch(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    path = tmp_path / "tokenizer.json"
    tokenizer.save(path)
    code = (
        "import sys; from index.bundle.tokenizer import TextTokenizer; "
        f"ids, _ = TextTokenizer.from_file({str(path)!r}).encode(['a dog']); "
        "assert 'torch' not in sys.modules; print(ids.shape)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "(1, 16)"


def test_build_tokenizer_uses_the_text_config() -> None:
    cfg = ModelConfig(text=TextTowerConfig(vocab_size=300, max_length=12))
    tok = build_tokenizer(cfg, iter(corpus()))
    assert tok.max_length == 12 and tok.vocab_size <= 300


def test_rejects_missing_or_unpadded_files(tokenizer: TextTokenizer, tmp_path: Path) -> None:
    with pytest.raises(TonearmError, match="not found"):
        TextTokenizer.from_file(tmp_path / "nope.json")
    data = json.loads(tokenizer.to_str())
    data["padding"] = None
    bad = tmp_path / "unpadded.json"
    bad.write_text(json.dumps(data), encoding="utf-8")
    with pytest.raises(TonearmError, match="unpadded.json"):
        TextTokenizer.from_file(bad)
    garbage = tmp_path / "garbage.json"
    garbage.write_text("{not json", encoding="utf-8")
    with pytest.raises(TonearmError, match="garbage.json"):
        TextTokenizer.from_file(garbage)
