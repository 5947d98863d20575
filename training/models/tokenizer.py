"""Build the text tokenizer of a run (SPEC §3).

* ``builtin`` text tower: a byte-level BPE trained here with ``tokenizers`` on the
  training captions of all languages. Byte-level means every string is
  representable (CJK, accents, emoji) without an unknown token; frequent CJK
  characters and words become single tokens. Normalisation: NFKC, lowercase,
  strip. Every sequence is ``<s> … </s>``; ``<pad>`` is id 0.
* ``hf_*`` text towers: the model directory's fast tokenizer (``tokenizer.json``),
  unchanged except for fixed padding/truncation to ``model.text.max_length``.

Either way the result is an :class:`index.bundle.tokenizer.TextTokenizer` whose
``tokenizer.json`` reproduces training tokenization in the torch-free service.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from tokenizers import (
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from index.bundle.tokenizer import TextTokenizer
from training.config import ConfigError, ModelConfig

PAD, BOS, EOS = "<pad>", "<s>", "</s>"
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "sentencepiece.bpe.model", "spiece.model", "vocab.json")
"""Files a Hugging Face tokenizer is built from (fast ``tokenizer.json`` first)."""
SPECIAL_TOKENS = [PAD, BOS, EOS]


def with_fixed_length(
    tokenizer: Tokenizer, *, max_length: int, pad_id: int, pad_token: str
) -> Tokenizer:
    """Enable right padding and truncation to exactly ``max_length`` tokens."""
    tokenizer.enable_truncation(max_length=max_length)
    tokenizer.enable_padding(
        direction="right", pad_id=pad_id, pad_token=pad_token, length=max_length
    )
    return tokenizer


def train_bpe_tokenizer(texts: Iterable[str], *, vocab_size: int, max_length: int) -> TextTokenizer:
    """Train a byte-level BPE on ``texts`` (vocab ≤ ``vocab_size``, smaller on tiny corpora)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.Sequence(
        [normalizers.NFKC(), normalizers.Lowercase(), normalizers.Strip()]
    )
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    bos, eos = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A {EOS}", special_tokens=[(BOS, bos), (EOS, eos)]
    )
    pad_id = tokenizer.token_to_id(PAD)
    return TextTokenizer(
        with_fixed_length(tokenizer, max_length=max_length, pad_id=pad_id, pad_token=PAD)
    )


def load_hf_tokenizer(path: str, *, max_length: int) -> TextTokenizer:
    """The fast tokenizer of a Hugging Face model directory (or hub id), fixed to ``max_length``."""
    from transformers import AutoTokenizer

    from training.models.hf import check_model_folder, first_line, hub_note

    check_model_folder(path, key="model.text.path", weights=False)
    folder = Path(path).expanduser()
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(
            f"model.text.path: no tokenizer in {folder} (expected tokenizer.json, or "
            f"{', '.join(TOKENIZER_FILES[1:])} with tokenizer_config.json)"
        )
    try:
        hf = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(
            f"model.text.path {path!r}{hub_note(path)}: its tokenizer cannot be loaded: {first_line(err)}"
        ) from None
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise ConfigError(f"model.text.path {path!r}: needs a fast tokenizer (tokenizer.json)")
    if hf.pad_token_id is None:
        raise ConfigError(f"model.text.path {path!r}: the tokenizer defines no pad token")
    tokenizer = Tokenizer.from_str(backend.to_str())
    tokenizer.no_padding()
    tokenizer.no_truncation()
    fixed = with_fixed_length(
        tokenizer, max_length=max_length, pad_id=int(hf.pad_token_id), pad_token=str(hf.pad_token)
    )
    return TextTokenizer(fixed)


def build_tokenizer(model_cfg: ModelConfig, texts: Iterable[str]) -> TextTokenizer:
    """The tokenizer of ``model_cfg.text``: trained BPE (``builtin``) or the HF model's own."""
    text = model_cfg.text
    if text.kind == "builtin":
        return train_bpe_tokenizer(texts, vocab_size=text.vocab_size, max_length=text.max_length)
    path = text.path
    if path is None and text.kind in ("hf_clap", "hf_pe_audio") and model_cfg.audio.kind == text.kind:
        path = model_cfg.audio.path  # the CLAP / PE-Audio pair: one directory for both towers
    if path is None:
        raise ConfigError(f"model.text.path is required for model.text.kind={text.kind!r}")
    return load_hf_tokenizer(path, max_length=text.max_length)
