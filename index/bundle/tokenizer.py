"""Text tokenizer shared by training and the torch-free service (one ``tokenizer.json``).

The file is a Hugging Face ``tokenizers`` serialisation that carries everything
needed to reproduce training tokenization exactly: normaliser, pre-tokenizer,
BPE/WordPiece model, the post-processor adding special tokens, and fixed
padding + truncation to ``max_length`` (right side). Training builds it
(``training.models.tokenizer.build_tokenizer``); bundles copy it; the service
loads it with :meth:`TextTokenizer.from_file`.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer

from index.errors import TonearmError


class TextTokenizer:
    """Fixed-length batch tokenization: texts → ``(input_ids, attention_mask)`` int64 (B, L)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        padding, truncation = tokenizer.padding, tokenizer.truncation
        if truncation is None or padding is None or padding.get("length") is None:
            raise TonearmError(
                "tokenizer has no fixed padding/truncation length; "
                "it must be built with training.models.tokenizer"
            )
        if padding["length"] != truncation["max_length"]:
            raise TonearmError(
                f"tokenizer padding length {padding['length']} != "
                f"truncation max_length {truncation['max_length']}"
            )
        self._tokenizer = tokenizer

    @classmethod
    def from_file(cls, path: Path | str) -> TextTokenizer:
        """Load a ``tokenizer.json``; raises :class:`TonearmError` naming the file."""
        path = Path(path)
        if not path.is_file():
            raise TonearmError(f"tokenizer file not found: {path}")
        try:
            tokenizer = Tokenizer.from_file(str(path))
        except Exception as err:  # tokenizers raises a bare Exception for bad JSON
            raise TonearmError(f"{path}: not a valid tokenizer.json ({err})") from None
        try:
            return cls(tokenizer)
        except TonearmError as err:
            raise TonearmError(f"{path}: {err}") from None

    def save(self, path: Path | str) -> None:
        """Write the ``tokenizer.json`` (padding and truncation included)."""
        self._tokenizer.save(str(path))

    def to_str(self) -> str:
        """The JSON serialisation (what :meth:`save` writes)."""
        return self._tokenizer.to_str()

    @property
    def max_length(self) -> int:
        truncation = self._tokenizer.truncation
        assert truncation is not None  # checked in __init__
        return int(truncation["max_length"])

    @property
    def vocab_size(self) -> int:
        """Size of the id space (embedding rows a model needs), added tokens included."""
        return int(self._tokenizer.get_vocab_size(with_added_tokens=True))

    @property
    def pad_id(self) -> int:
        padding = self._tokenizer.padding
        assert padding is not None  # checked in __init__
        return int(padding["pad_id"])

    @property
    def backend(self) -> Tokenizer:
        """The underlying ``tokenizers.Tokenizer`` (decode, token strings)."""
        return self._tokenizer

    def encode(self, texts: Sequence[str], *, pad_to_longest: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """Tokenize a batch; both arrays are int64 of shape (len(texts), max_length).

        ``pad_to_longest`` cuts the trailing columns no text of the batch uses, so the arrays are
        (len(texts), longest) instead: a batch of short queries costs the encoder its own length,
        not ``max_length`` (the towers mask padding, so the embeddings do not change; right
        padding only — a left-padded tokenizer keeps the full width)."""
        if isinstance(texts, str):
            raise TypeError("encode() takes a sequence of strings, not a single string")
        encodings = self._tokenizer.encode_batch(list(texts))
        n = len(encodings)
        ids = np.array([e.ids for e in encodings], dtype=np.int64).reshape(n, self.max_length)
        mask = np.array([e.attention_mask for e in encodings], dtype=np.int64).reshape(n, self.max_length)
        if pad_to_longest and n and self.padding_side == "right":
            longest = max(1, int(mask.sum(axis=1).max()))
            ids, mask = np.ascontiguousarray(ids[:, :longest]), np.ascontiguousarray(mask[:, :longest])
        return ids, mask

    @property
    def padding_side(self) -> str:
        padding = self._tokenizer.padding
        assert padding is not None  # checked in __init__
        return str(padding.get("direction", "right"))
