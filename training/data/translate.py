"""``tonearm data translate``: machine-translate a manifest's English captions (SPEC §2, §13).

Reads a JSONL manifest, translates every English caption into each ``--to`` language and
writes a manifest in the same layout, the translation of English caption ``i`` at position
``i`` of each language (a query group, SPEC §5). Two kinds of translator, chosen by flag:

* ``--model DIR`` (or ``--model LANG=DIR`` per language): a local sequence-to-sequence
  model through transformers — Marian/Opus-MT (one folder per language pair), M2M100,
  NLLB or MADLAD (one many-to-many folder, the target chosen by its language code); a
  CTranslate2 conversion of such a folder (``model.bin``) runs through ``ctranslate2``;
* ``--endpoint URL``: an OpenAI-compatible chat-completions server (what ATRI used),
  captions sent in batches as a JSON array, with retries.

Every translation is stored in a SQLite cache keyed by (translator, language, caption) as
soon as its batch returns, so an interrupted run resumes where it stopped and a caption
shared by several clips is translated once; a local model's key holds the sha256 of its
files' bytes (remembered in the cache by path, size, mtime, ctime and inode). Progress goes to
stderr; the report (also written as ``OUT.report.json``) counts per language the flagged
outputs — empty, copies of the source, wrong-script outputs (``jpn``/``zho``/Latin/Cyrillic
targets) and runaway lengths, each with its threshold (:class:`Checks`) — and how many were
left out: empty ones always, the others with ``--drop-flagged``. A left-out output ends the
clip's list in that language (positions stay aligned); its other languages stay.

This module imports no torch/transformers/httpx at import time (the CLI parser is built
from it); the translators import what they need when constructed.
"""

from __future__ import annotations

import argparse
import difflib
import hashlib
import json
import logging
import math
import os
import re
import sqlite3
import sys
import time
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from index.errors import DataError, TonearmError
from index.languages import ENGLISH, validate_language_codes
from training.data.manifest import ClipRecord, read_manifest, write_manifest

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Language:
    """What each translator family calls a language, and the script its text is written in."""

    name: str
    m2m100: str
    nllb: str
    script: str  # "latin", "japanese", "han", "cyrillic", "other"


LANGUAGES: dict[str, Language] = {
    "eng": Language("English", "en", "eng_Latn", "latin"),
    "fra": Language("French", "fr", "fra_Latn", "latin"),
    "deu": Language("German", "de", "deu_Latn", "latin"),
    "spa": Language("Spanish", "es", "spa_Latn", "latin"),
    "nld": Language("Dutch", "nl", "nld_Latn", "latin"),
    "cat": Language("Catalan", "ca", "cat_Latn", "latin"),
    "jpn": Language("Japanese", "ja", "jpn_Jpan", "japanese"),
    "zho": Language("Chinese (Simplified)", "zh", "zho_Hans", "han"),
    "ita": Language("Italian", "it", "ita_Latn", "latin"),
    "por": Language("Portuguese", "pt", "por_Latn", "latin"),
    "pol": Language("Polish", "pl", "pol_Latn", "latin"),
    "rus": Language("Russian", "ru", "rus_Cyrl", "cyrillic"),
    "ukr": Language("Ukrainian", "uk", "ukr_Cyrl", "cyrillic"),
    "kor": Language("Korean", "ko", "kor_Hang", "other"),
    "ara": Language("Arabic", "ar", "arb_Arab", "other"),
    "hin": Language("Hindi", "hi", "hin_Deva", "other"),
    "tur": Language("Turkish", "tr", "tur_Latn", "latin"),
    "swe": Language("Swedish", "sv", "swe_Latn", "latin"),
}
"""ISO 639-3 → names and codes of the translator families. Other codes: ``--lang-code``."""

MARIAN_ALIASES: dict[str, tuple[str, ...]] = {"zho": ("cmn_Hans", "cmn", "zho_Hans")}
"""Target tags multi-target Opus-MT models use for a language besides its ISO 639-3 code."""

DEFAULT_TARGETS = ("fra", "deu", "spa", "nld", "cat", "jpn", "zho")


def language(code: str) -> Language:
    if code not in LANGUAGES:
        raise DataError(
            f"language {code!r} has no entry in the translation table (known: {', '.join(sorted(LANGUAGES))}); "
            f"give the translator's code or, for --endpoint, the language's name: --lang-code {code}=CODE_OR_NAME"
        )
    return LANGUAGES[code]


# --------------------------------------------------------------------------- translators


class Translator(Protocol):
    """Translates batches of English captions into one language at a time."""

    def key_for(self, target: str) -> str:
        """Identity in the cache: a different model, prompt or decoding gives another key."""
        ...

    @property
    def concurrency(self) -> int:
        """How many batches may be in flight at once (1 for a local model)."""
        ...

    def translate(self, texts: Sequence[str], target: str) -> list[str]:
        """One output per input, in order (an empty string where the translator gave nothing)."""
        ...

    def close(self) -> None: ...


MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".gguf",
                       ".model", ".spm", ".json", ".txt", ".tiktoken")
"""Files of a model folder whose bytes make its translations: weights, configs, tokenizer, vocabularies."""


def sha256_file(path: Path) -> str:
    """Streaming sha256 of a file's bytes (8 MiB at a time)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(8 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def model_files(folder: Path) -> list[Path]:
    """The files of ``folder`` (top level, links followed) that :data:`MODEL_FILE_SUFFIXES` names, sorted."""
    return sorted(f for f in folder.iterdir()
                  if not f.name.startswith(".") and f.name.endswith(MODEL_FILE_SUFFIXES) and f.is_file())


def _fingerprint(folder: Path, digest: Callable[[Path], str] = sha256_file) -> str:
    """Digest of the model's bytes: each model file's name and sha256 (not its path: a copied folder reuses
    the cache, a re-trained model saved in the same folder does not)."""
    combined = hashlib.sha256()
    for path in model_files(folder):
        combined.update(f"{path.name}\0{digest(path)}\0".encode())
    return combined.hexdigest()[:16]


def detect_family(folder: Path) -> str:
    """``marian``, ``m2m100``, ``nllb`` or ``madlad`` from the folder's config and tokenizer files."""
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise DataError(f"--model {folder}: no config.json (expected a transformers or CTranslate2 model folder)")
    config = json.loads(config_path.read_text(encoding="utf-8"))
    model_type = str(config.get("model_type", ""))
    tokenizer_class = ""
    if (folder / "tokenizer_config.json").is_file():
        tokenizer_class = str(json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
                              .get("tokenizer_class", ""))
    if model_type == "marian" or "Marian" in tokenizer_class:
        return "marian"
    if "Nllb" in tokenizer_class:
        return "nllb"
    if model_type == "m2m_100" or "M2M100" in tokenizer_class:
        return "m2m100"
    if model_type in {"t5", "mt5"} or "T5" in tokenizer_class:
        return "madlad"
    raise DataError(
        f"--model {folder}: model_type {model_type!r} is not a supported translation model "
        "(Marian/Opus-MT, M2M100, NLLB, MADLAD-400)"
    )


class Seq2SeqTranslator:
    """Local model folders through transformers (or CTranslate2 for a ``model.bin`` folder).

    ``models`` maps a target language to its folder; the key ``"*"`` is a many-to-many model
    used for every language without a folder of its own.
    """

    def __init__(self, models: Mapping[str, Path], *, device: str = "cpu", batch_size: int = 32,
                 beams: int = 1, max_new_tokens: int = 128, threads: int | None = None,
                 lang_codes: Mapping[str, str] | None = None, source: str = ENGLISH,
                 compute_type: str = "default", digest: Callable[[Path], str] | None = None) -> None:
        if not models:
            raise DataError("--model: give a folder (many-to-many) or LANG=FOLDER per language")
        self.models = {lang: Path(path) for lang, path in models.items()}
        for lang, path in self.models.items():
            if not path.is_dir():
                raise DataError(f"--model {lang + '=' if lang != '*' else ''}{path}: folder not found")
        self.families = {lang: detect_family(path) for lang, path in self.models.items()}
        self.device = device
        self.batch_size = batch_size
        self.beams = beams
        self.max_new_tokens = max_new_tokens
        self.threads = threads
        self.compute_type = compute_type
        self.lang_codes = dict(lang_codes or {})
        self.source = source
        self.digest = digest or sha256_file
        self._fingerprints: dict[Path, str] = {}  # once per folder and run
        self._loaded: tuple[Path, Any, Any, bool] | None = None

    @property
    def concurrency(self) -> int:
        return 1

    def folder(self, target: str) -> Path:
        if target in self.models:
            return self.models[target]
        if "*" in self.models:
            return self.models["*"]
        raise DataError(f"--model: no model folder for {target} (give {target}=FOLDER or one many-to-many folder)")

    def key_for(self, target: str) -> str:
        """Cache key of one target language: only that language's model counts, and every option that
        changes its output — the model, beams, token budget, CTranslate2 precision, a ``--lang-code``
        override of the target's code and a source language other than English (issue 49)."""
        lang = target if target in self.models else "*"
        folder = self.folder(target)
        ct2 = f"|ct2={self.compute_type}" if (folder / "model.bin").is_file() else ""
        if folder not in self._fingerprints:
            self._fingerprints[folder] = _fingerprint(folder, self.digest)
        code = f"|code={self.lang_codes[target]}" if target in self.lang_codes else ""
        source = f"|src={self.source}" if self.source != ENGLISH else ""
        return (f"seq2seq|{self.families[lang]}:{self._fingerprints[folder]}|beams={self.beams}"
                f"|max_new_tokens={self.max_new_tokens}{ct2}{code}{source}")

    def _load(self, folder: Path) -> tuple[Any, Any, bool]:
        if self._loaded is not None and self._loaded[0] == folder:
            return self._loaded[1], self._loaded[2], self._loaded[3]
        self._loaded = None
        from transformers import AutoTokenizer

        if self.threads:
            import torch

            torch.set_num_threads(self.threads)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        ct2 = (folder / "model.bin").is_file()
        if ct2:
            try:
                import ctranslate2
            except ModuleNotFoundError:
                raise DataError(f"--model {folder} is a CTranslate2 folder: pip install ctranslate2") from None
            model: Any = ctranslate2.Translator(
                str(folder), device=self.device, inter_threads=1, intra_threads=self.threads or 0,
                compute_type=self.compute_type,
            )
        else:
            from transformers import AutoModelForSeq2SeqLM

            model = AutoModelForSeq2SeqLM.from_pretrained(folder).to(self.device).eval()
        self._loaded = (folder, tokenizer, model, ct2)
        return tokenizer, model, ct2

    def _code(self, family: str, target: str) -> str:
        if target in self.lang_codes:
            return self.lang_codes[target]
        lang = language(target)
        return {"nllb": lang.nllb, "m2m100": lang.m2m100, "madlad": f"<2{lang.m2m100}>"}.get(family, "")

    def translate(self, texts: Sequence[str], target: str) -> list[str]:
        tokenizer, ids = self.generate_ids(texts, target)
        return [s.strip() for s in tokenizer.batch_decode(ids, skip_special_tokens=True)]

    def generate_ids(self, texts: Sequence[str], target: str) -> tuple[Any, list[list[int]]]:
        """The tokenizer and the generated token ids of each text, the target language's forcing included.

        transformers: ``generate``'s rows (the decoder start token, then — M2M100, NLLB — the target
        language token forced by ``forced_bos_token_id``); CTranslate2: the best hypothesis, which starts
        with its ``target_prefix`` (the language token). MADLAD and multi-target Marian put their
        ``<2xx>`` / ``>>xxx<<`` token in front of the source instead.
        """
        import torch

        folder = self.folder(target)
        family = self.families[target if target in self.models else "*"]
        tokenizer, model, ct2 = self._load(folder)
        code = self._code(family, target)
        sources = list(texts)
        forced: int | None = None
        if family == "marian":
            sources = [f"{token} {t}" for t in sources] if (token := self._marian_token(tokenizer, target)) \
                else sources
        elif family == "madlad":
            self._token_id(tokenizer, code, folder, target)
            sources = [f"{code} {t}" for t in sources]
        elif family in {"m2m100", "nllb"}:
            tokenizer.src_lang = self._code(family, self.source)
            forced = self._token_id(tokenizer, code if family == "nllb" else f"__{code}__", folder, target)
        if ct2:
            tokens = [tokenizer.convert_ids_to_tokens(tokenizer.encode(t)) for t in sources]
            prefix = [[tokenizer.convert_ids_to_tokens(forced)]] * len(tokens) if forced is not None else None
            results = model.translate_batch(tokens, target_prefix=prefix, beam_size=self.beams,
                                            max_decoding_length=self.max_new_tokens, max_batch_size=self.batch_size)
            return tokenizer, [tokenizer.convert_tokens_to_ids(r.hypotheses[0]) for r in results]
        batch = tokenizer(sources, return_tensors="pt", padding=True, truncation=True, max_length=256)
        batch = {k: v.to(self.device) for k, v in batch.items()}
        kwargs: dict[str, Any] = {"num_beams": self.beams, "do_sample": False, "max_new_tokens": self.max_new_tokens}
        if forced is not None:
            kwargs["forced_bos_token_id"] = forced
        with torch.inference_mode():
            out = model.generate(**batch, **kwargs)
        return tokenizer, out.tolist()

    @staticmethod
    def _token_id(tokenizer: Any, token: str, folder: Path, target: str) -> int:
        """The id of a language token, or a clear error when the tokenizer does not have it as one token."""
        found = tokenizer.convert_tokens_to_ids(token)
        if found is None or found == tokenizer.unk_token_id:
            raise DataError(f"--model {folder}: its tokenizer has no language token {token!r} for {target} "
                            f"(pass --lang-code {target}=CODE)")
        return int(found)

    def _marian_token(self, tokenizer: Any, target: str) -> str:
        """``>>fra<<`` for a multi-target Opus-MT folder (opus-mt-en-mul, …); ``""`` for a one-pair folder.

        A one-pair folder translates into its own language whatever is asked, so it is accepted
        only as ``LANG=FOLDER``, never as the folder for every language.
        """
        folder = self.folder(target)
        tags = [t for t in tokenizer.get_vocab() if t.startswith(">>") and t.endswith("<<")]
        if not tags:
            if target not in self.models:
                raise DataError(f"--model {folder} is a one-pair Marian (Opus-MT) model: name its target language, "
                                f"e.g. --model {target}={folder}, and give a folder per language")
            return ""
        wanted = [self.lang_codes[target]] if target in self.lang_codes else [target, *MARIAN_ALIASES.get(target, ())]
        for code in wanted:
            if f">>{code}<<" in tags:
                return f">>{code}<<"
        raise DataError(f"--model {folder}: this multi-target Marian model has no >>{wanted[0]}<< token "
                        f"(it has {', '.join(sorted(tags)[:12])}, …); pass --lang-code {target}=CODE")

    def close(self) -> None:
        self._loaded = None


CHAT_PROMPT_VERSION = 1
SYSTEM_BATCH = (
    "You translate short English captions that describe sounds into {language}. "
    "The user sends a JSON array of {n} captions. Reply with only a JSON array of {n} strings: "
    "the translations, in the same order, one per caption, natural and faithful, nothing else."
)
SYSTEM_SINGLE = (
    "You translate a short English caption that describes sounds into {language}. "
    "Reply with only the translation."
)
RETRY_STATUS = {408, 409, 425, 429, 500, 502, 503, 504}


class ChatTranslator:
    """An OpenAI-compatible ``/chat/completions`` endpoint, ``batch_size`` captions a request.

    A reply that is not a JSON array of as many strings falls back to one request per caption.
    Transient failures (connection errors, timeouts, 408/429/5xx) are retried ``retries`` times
    with exponential back-off (``Retry-After`` honoured); anything else stops the run with the
    endpoint's answer — the cache keeps what was translated, so the same command resumes.
    """

    def __init__(self, url: str, *, model: str, api_key: str | None = None, batch_size: int = 20,
                 concurrency: int = 4, retries: int = 5, retry_wait: float = 1.0, timeout: float = 120.0,
                 temperature: float = 0.0, lang_names: Mapping[str, str] | None = None) -> None:
        import httpx

        url = url.rstrip("/")
        self.url = url if url.endswith("/chat/completions") else f"{url}/chat/completions"
        self.model = model
        self.batch_size = batch_size
        self._concurrency = max(1, concurrency)
        self.retries = retries
        self.retry_wait = retry_wait
        self.temperature = temperature
        self.lang_names = dict(lang_names or {})
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(timeout=timeout, headers=headers,
                                   limits=httpx.Limits(max_connections=self._concurrency))
        self._key = f"chat|{self.url}|{model}|t={temperature}|prompt=v{CHAT_PROMPT_VERSION}"

    @property
    def concurrency(self) -> int:
        return self._concurrency

    def key_for(self, target: str) -> str:
        """The endpoint, model, temperature and prompt, and a ``--lang-code`` name of the target (the prompt's)."""
        return self._key + (f"|name={self.lang_names[target]}" if target in self.lang_names else "")

    def _post(self, messages: list[dict[str, str]]) -> str:
        import httpx

        body = {"model": self.model, "messages": messages, "temperature": self.temperature}
        last = ""
        for attempt in range(self.retries + 1):
            wait = self.retry_wait * 2**attempt
            try:
                response = self.client.post(self.url, json=body)
            except httpx.TransportError as err:
                last = f"{type(err).__name__}: {err}"
            else:
                if response.status_code == 200:
                    try:
                        return str(response.json()["choices"][0]["message"]["content"] or "")
                    except (ValueError, KeyError, IndexError, TypeError):
                        raise TonearmError(
                            f"--endpoint {self.url}: the answer is not a chat completion: {response.text[:300]!r}"
                        ) from None
                last = f"HTTP {response.status_code}: {response.text[:300]}"
                if response.status_code not in RETRY_STATUS:
                    hint = " (check the key in --api-key-env)" if response.status_code in {401, 403} else ""
                    raise TonearmError(f"--endpoint {self.url} (model {self.model!r}) answered {last}{hint}")
                retry_after = response.headers.get("retry-after", "")
                if retry_after.replace(".", "", 1).isdigit():
                    wait = max(wait, float(retry_after))
            if attempt < self.retries:
                log.warning("--endpoint %s: %s; retrying in %.1f s", self.url, last, min(wait, 60.0))
                time.sleep(min(wait, 60.0))
        raise TonearmError(
            f"--endpoint {self.url}: no answer after {self.retries + 1} attempt{'s' if self.retries else ''} "
            f"(last: {last}); what was translated is "
            "cached: run the same command again to resume"
        )

    def translate(self, texts: Sequence[str], target: str) -> list[str]:
        name = self.lang_names.get(target) or language(target).name
        if len(texts) > 1:
            reply = self._post([
                {"role": "system", "content": SYSTEM_BATCH.format(language=name, n=len(texts))},
                {"role": "user", "content": json.dumps(list(texts), ensure_ascii=False)},
            ])
            parsed = parse_json_array(reply, len(texts))
            if parsed is not None:
                return parsed
            log.info("--endpoint: a batch reply was not a JSON array of %d strings; one request per caption",
                     len(texts))
        return [
            self._post([
                {"role": "system", "content": SYSTEM_SINGLE.format(language=name)},
                {"role": "user", "content": text},
            ]).strip()
            for text in texts
        ]

    def close(self) -> None:
        self.client.close()


def parse_json_array(reply: str, n: int) -> list[str] | None:
    """The JSON array of ``n`` strings in a reply (code fences and chatter around it allowed)."""
    start, end = reply.find("["), reply.rfind("]")
    if start < 0 or end <= start:
        return None
    try:
        value = json.loads(reply[start:end + 1])
    except json.JSONDecodeError:
        return None
    if not isinstance(value, list) or len(value) != n or not all(isinstance(v, str) for v in value):
        return None
    return [v.strip() for v in value]


# --------------------------------------------------------------------------- cache


class TranslationCache:
    """SQLite table (translator, lang, source) → translation; committed after every batch."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self.db = sqlite3.connect(self.path, timeout=120.0)  # parallel runs may share one cache
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS translations (translator TEXT NOT NULL, lang TEXT NOT NULL, "
                "source TEXT NOT NULL, target TEXT NOT NULL, PRIMARY KEY (translator, lang, source))"
            )
            self.db.execute(
                "CREATE TABLE IF NOT EXISTS file_digests (path TEXT PRIMARY KEY, size INTEGER, mtime_ns INTEGER, "
                "ctime_ns INTEGER, inode INTEGER, sha256 TEXT NOT NULL)"
            )
            self.db.commit()
        except sqlite3.DatabaseError as err:
            raise DataError(f"--cache {self.path}: not a usable SQLite file ({err})") from None

    def file_digest(self, path: Path) -> str:
        """sha256 of a file's bytes, remembered in this cache by (path, size, mtime, ctime, inode): a model's
        weights are read once, not on every run; a file written again (new mtime/ctime) is read again."""
        path = Path(path).resolve()
        st = path.stat()
        stamp = (str(path), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)
        row = self.db.execute("SELECT sha256 FROM file_digests WHERE path=? AND size=? AND mtime_ns=? AND ctime_ns=? "
                              "AND inode=?", stamp).fetchone()
        if row:
            return str(row[0])
        digest = sha256_file(path)
        self.db.execute("INSERT OR REPLACE INTO file_digests VALUES (?, ?, ?, ?, ?, ?)", (*stamp, digest))
        self.db.commit()
        return digest

    def get_many(self, translator: str, lang: str, sources: Sequence[str]) -> dict[str, str]:
        found: dict[str, str] = {}
        for start in range(0, len(sources), 500):
            chunk = list(sources[start:start + 500])
            marks = ",".join("?" * len(chunk))
            rows = self.db.execute(
                f"SELECT source, target FROM translations WHERE translator=? AND lang=? AND source IN ({marks})",
                [translator, lang, *chunk],
            )
            found.update(dict(rows.fetchall()))
        return found

    def put_many(self, translator: str, lang: str, pairs: Sequence[tuple[str, str]]) -> None:
        self.db.executemany(
            "INSERT OR REPLACE INTO translations VALUES (?, ?, ?, ?)",
            [(translator, lang, source, target) for source, target in pairs],
        )
        self.db.commit()

    def close(self) -> None:
        self.db.close()


# --------------------------------------------------------------------------- checks and report

_KANA = re.compile(r"[\u3040-\u30ff\u31f0-\u31ff\uff66-\uff9f]")
_HAN = re.compile(r"[\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff]")
_LATIN = re.compile(r"[A-Za-z\u00c0-\u024f]")
_CYRILLIC = re.compile(r"[\u0400-\u04ff]")
_WORD = re.compile(r"\W+")


def _share(pattern: re.Pattern[str], text: str) -> float:
    letters = [c for c in text if c.isalpha()]
    return sum(1 for c in letters if pattern.match(c)) / len(letters) if letters else 0.0


@dataclass(frozen=True)
class Checks:
    """The thresholds of the flags (``tonearm data translate --copy-similarity`` …)."""

    copy_similarity: float = 1.0
    """``copied`` when the output's similarity to the source (difflib's ratio of the two texts lower-cased,
    punctuation dropped) is at least this; 1.0: identical."""
    min_script_share: float = 0.5
    """``wrong_script`` when less than this share of the output's letters are in the target's script."""
    max_length_ratio: float = 3.0
    """``too_long`` when the output has more than this many characters per source character (+ 20)."""

    def __post_init__(self) -> None:
        for name, value, high in (("--copy-similarity", self.copy_similarity, 1.0),
                                  ("--min-script-share", self.min_script_share, 1.0),
                                  ("--max-length-ratio", self.max_length_ratio, math.inf)):
            if not 0.0 < value <= high:
                raise DataError(f"{name} {value}: expected a number above 0{f' and at most {high}' if high < 10 else ''}")


LENGTH_SLACK = 20
"""Characters an output may have beyond ``max_length_ratio`` × the source's (short captions)."""


def suspicion(source: str, output: str, target: str, checks: Checks | None = None) -> str | None:
    """Why an output looks wrong (``empty``, ``copied``, ``wrong_script``, ``too_long``), or None."""
    checks = checks or Checks()
    if not output.strip():
        return "empty"
    norm_out, norm_src = _WORD.sub(" ", output.lower()).strip(), _WORD.sub(" ", source.lower()).strip()
    if len(norm_src) > 3 and (norm_out == norm_src or (
            checks.copy_similarity < 1.0
            and difflib.SequenceMatcher(None, norm_src, norm_out, autojunk=False).ratio() >= checks.copy_similarity)):
        return "copied"
    script = LANGUAGES[target].script if target in LANGUAGES else "other"
    least = checks.min_script_share
    if script == "japanese":
        if _share(_KANA, output) + _share(_HAN, output) < least:
            return "wrong_script"
    elif script == "han":
        if _share(_HAN, output) < least or _KANA.search(output):
            return "wrong_script"
    elif script == "latin":
        if _share(_LATIN, output) < least:
            return "wrong_script"
    elif script == "cyrillic" and _share(_CYRILLIC, output) < least:
        return "wrong_script"
    if len(output) > checks.max_length_ratio * len(source) + LENGTH_SLACK:
        return "too_long"
    return None


SUSPICIONS = ("empty", "copied", "wrong_script", "too_long")
DROPPABLE = SUSPICIONS[1:]
"""Flags ``--drop-flagged`` can drop (an empty output is always left out)."""
EXAMPLES = 3


def parse_drop(value: str | None) -> frozenset[str]:
    """``--drop-flagged [FLAG,...]``: ``None`` → keep every flagged output; ``"all"`` → drop every flag."""
    if value is None:
        return frozenset()
    names = [n.strip() for n in value.split(",") if n.strip()]
    if names == ["all"]:
        return frozenset(DROPPABLE)
    unknown = [n for n in names if n not in DROPPABLE]
    if unknown or not names:
        raise DataError(f"--drop-flagged {value!r}: expected nothing (every flag), all, or a comma-separated "
                        f"list of {', '.join(DROPPABLE)}")
    return frozenset(names)


@dataclass
class LanguageReport:
    """What happened to one target language."""

    captions: int = 0  # caption positions written or dropped (English captions of the clips)
    unique: int = 0
    translated: int = 0  # unique captions translated in this run
    cached: int = 0  # unique captions found in the cache
    kept_existing: int = 0  # clips that already had this language (not replaced)
    written: int = 0  # translations written into the manifest
    clips_without: int = 0  # clips left without this language (their first caption's output was left out)
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SUSPICIONS, 0))  # flagged outputs
    dropped: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SUSPICIONS, 0))  # of which left out
    left_behind: int = 0  # unflagged translations left out as they follow a dropped one (positions stay aligned)
    examples: dict[str, list[list[str]]] = field(default_factory=dict)

    def note(self, reason: str, source: str, output: str) -> None:
        self.counts[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES:
            shown.append([source, output])


# --------------------------------------------------------------------------- the run


class Progress:
    """A stderr line per language after the first batch, every ``every`` seconds and at the end."""

    def __init__(self, lang: str, total: int, *, enabled: bool = True, every: float = 2.0) -> None:
        self.lang, self.total, self.enabled, self.every = lang, total, enabled, every
        self.done = 0
        self.start = self.last = time.monotonic()

    def advance(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if self.enabled and (self.done == n or now - self.last >= self.every or self.done >= self.total):
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else math.inf
            eta_text = f"{eta / 60:.1f} min" if math.isfinite(eta) else "?"
            sys.stderr.write(f"translate {self.lang}: {self.done}/{self.total} captions "
                             f"({rate:.1f}/s, {eta_text} left)\n")
            sys.stderr.flush()


def _batches(items: Sequence[str], size: int) -> Iterator[list[str]]:
    for start in range(0, len(items), size):
        yield list(items[start:start + size])


def translate_missing(translator: Any, cache: TranslationCache, lang: str, sources: Sequence[str], *,
                      batch_size: int, progress: bool = True) -> int:
    """Translate the ``sources`` not in the cache, storing each batch as it returns; how many were translated."""
    key = translator.key_for(lang)
    found = cache.get_many(key, lang, sources)
    todo = [s for s in sources if s not in found]
    if not todo:
        return 0
    # Similar lengths together: less padding for local models (order does not matter: cached by text).
    todo.sort(key=len)
    bar = Progress(lang, len(todo), enabled=progress)

    def store(batch: list[str], outputs: list[str]) -> None:
        if len(outputs) != len(batch):
            raise TonearmError(f"translator returned {len(outputs)} outputs for {len(batch)} captions ({lang})")
        cache.put_many(key, lang, list(zip(batch, outputs, strict=True)))
        bar.advance(len(batch))

    batches = list(_batches(todo, batch_size))
    if translator.concurrency <= 1:
        for batch in batches:
            store(batch, translator.translate(batch, lang))
        return len(todo)
    with ThreadPoolExecutor(max_workers=translator.concurrency) as pool:
        pending: list[tuple[list[str], Future[list[str]]]] = []
        try:
            for batch in batches:
                pending.append((batch, pool.submit(translator.translate, batch, lang)))
            for batch, future in pending:
                store(batch, future.result())
        except BaseException:
            for _, future in pending:
                future.cancel()
            # keep what finished: the next run starts from it
            for batch, future in pending:
                if future.done() and not future.cancelled() and future.exception() is None:
                    cache.put_many(key, lang, list(zip(batch, future.result(), strict=True)))
            raise
    return len(todo)


def translate_records(records: Sequence[ClipRecord], translator: Any, cache: TranslationCache,
                      targets: Sequence[str], *, batch_size: int, replace: bool = False,
                      source_lang: str = ENGLISH, progress: bool = True, checks: Checks | None = None,
                      drop: Collection[str] = (),
                      ) -> tuple[list[ClipRecord], dict[str, LanguageReport]]:
    """Records with ``targets`` captions added (aligned by position) and the per-language report.

    Every output is checked (:func:`suspicion` with ``checks``); empty ones and those whose flag is in
    ``drop`` are left out of the records, the rest are written (and flagged in the report).
    """
    unknown = set(drop) - set(DROPPABLE)
    if unknown:
        raise DataError(f"cannot drop {', '.join(sorted(unknown))}: the flags are {', '.join(DROPPABLE)}")
    reports: dict[str, LanguageReport] = {}
    out = [ClipRecord(r.id, r.audio, {k: list(v) for k, v in r.captions.items()}, r.split, dict(r.meta),
                      list(r.moments)) for r in records]
    with_source = [r for r in out if r.captions.get(source_lang)]
    if not with_source:
        raise DataError(f"no clip has {source_lang} captions to translate")
    for lang in targets:
        report = reports[lang] = LanguageReport()
        todo_records = [r for r in with_source if replace or lang not in r.captions]
        report.kept_existing = len(with_source) - len(todo_records)
        sources = list(dict.fromkeys(t for r in todo_records for t in r.captions[source_lang]))
        report.captions = sum(len(r.captions[source_lang]) for r in todo_records)
        report.unique = len(sources)
        report.translated = translate_missing(translator, cache, lang, sources, batch_size=batch_size,
                                              progress=progress)
        report.cached = report.unique - report.translated
        table = cache.get_many(translator.key_for(lang), lang, sources)
        for record in todo_records:
            # Position i of every language is the translation of English caption i: a left-out output
            # cannot leave a hole, so the clip keeps the translations before it (a shorter list, which
            # stays aligned) and loses the ones after it; its other languages are untouched.
            texts: list[str] = []
            stopped = False
            for source in record.captions[source_lang]:
                text = table[source].strip()
                reason = suspicion(source, text, lang, checks)
                if reason:
                    report.note(reason, source, text)
                if reason is not None and (reason == "empty" or reason in drop):
                    report.dropped[reason] += 1
                    stopped = True
                elif stopped:
                    report.left_behind += 1
                else:
                    texts.append(text)
            if texts:
                record.captions[lang] = texts
                report.written += len(texts)
            else:
                record.captions.pop(lang, None)
                report.clips_without += 1
    return out, reports


def format_report(reports: Mapping[str, LanguageReport]) -> str:
    """The stderr table: flagged outputs per flag, ``flagged/dropped`` where some were left out."""
    def cell(r: LanguageReport, flag: str) -> str:
        return f"{r.counts[flag]}/{r.dropped[flag]}" if r.dropped[flag] and flag != "empty" else str(r.counts[flag])

    lines = ["lang  captions  unique  translated  cached  empty  copied  wrong_script  too_long  written  "
             "left_behind  clips_without"]
    for lang, r in reports.items():
        lines.append(f"{lang:<5} {r.captions:>8}  {r.unique:>6}  {r.translated:>10}  {r.cached:>6}  "
                     f"{cell(r, 'empty'):>5}  {cell(r, 'copied'):>6}  {cell(r, 'wrong_script'):>12}  "
                     f"{cell(r, 'too_long'):>8}  {r.written:>7}  {r.left_behind:>11}  {r.clips_without:>13}")
    if any(r.dropped[f] for r in reports.values() for f in DROPPABLE):
        lines.append("(flagged/dropped: dropped outputs are not in the manifest; left_behind: unflagged translations "
                     "after a dropped one in the same clip, left out to keep positions aligned)")
    return "\n".join(lines)


# --------------------------------------------------------------------------- CLI


def parse_models(values: Sequence[str]) -> dict[str, Path]:
    """``["DIR"]`` → ``{"*": DIR}``; ``["fra=DIR", ...]`` → per language."""
    models: dict[str, Path] = {}
    for value in values:
        lang, sep, path = value.partition("=")
        if sep and re.fullmatch(r"[a-z]{3}", lang):
            key = lang
        else:
            key, path = "*", value
        if key in models:
            raise DataError(f"--model: {'the many-to-many folder' if key == '*' else key} given twice")
        models[key] = Path(path)
    return models


def parse_codes(values: Sequence[str] | None) -> dict[str, str]:
    codes: dict[str, str] = {}
    for value in values or []:
        lang, sep, code = value.partition("=")
        if not sep or not code:
            raise DataError(f"--lang-code {value!r}: expected LANG=CODE, e.g. zho=zho_Hant")
        codes[lang] = code
    return codes


def parse_targets(text: str, *, source_lang: str) -> list[str]:
    targets = [t.strip() for t in text.split(",") if t.strip()]
    try:
        validate_language_codes(targets)
    except ValueError as err:
        raise DataError(f"--to: {err}") from None
    if source_lang in targets:
        raise DataError(f"--to: {source_lang} is the source language")
    return targets


def build_translator(args: argparse.Namespace, *, digest: Callable[[Path], str] | None = None) -> Any:
    if bool(args.model) == bool(args.endpoint):
        raise DataError("choose one translator: --model FOLDER (or LANG=FOLDER ...) or --endpoint URL")
    if args.endpoint:
        if not args.endpoint_model:
            raise DataError("--endpoint needs --endpoint-model NAME (the model the server should use)")
        return ChatTranslator(args.endpoint, model=args.endpoint_model, api_key=os.environ.get(args.api_key_env),
                              batch_size=args.batch_size, concurrency=args.concurrency, retries=args.retries,
                              retry_wait=args.retry_wait, lang_names=parse_codes(args.lang_code))
    return Seq2SeqTranslator(parse_models(args.model), device=args.device, batch_size=args.batch_size,
                             beams=args.beams, max_new_tokens=args.max_new_tokens, threads=args.threads,
                             lang_codes=parse_codes(args.lang_code), source=args.source_lang,
                             compute_type=args.compute_type, digest=digest)


def cli_translate(args: argparse.Namespace) -> int:
    """``tonearm data translate``: the manifest with every English caption translated into ``--to``."""
    source_lang = args.source_lang
    targets = parse_targets(args.to, source_lang=source_lang)
    rows = read_manifest(Path(args.manifest), languages=None)
    out = Path(args.out)
    if out.resolve() == Path(args.manifest).resolve():
        raise DataError("--out must differ from the input manifest")
    checks = Checks(copy_similarity=args.copy_similarity, min_script_share=args.min_script_share,
                    max_length_ratio=args.max_length_ratio)
    drop = parse_drop(args.drop_flagged)
    cache = TranslationCache(Path(args.cache) if args.cache else out.with_name(out.name + ".cache.sqlite"))
    try:
        translator = build_translator(args, digest=cache.file_digest)
    except BaseException:
        cache.close()
        raise
    try:
        records, reports = translate_records(
            [r for _, r in rows], translator, cache, targets, batch_size=args.batch_size,
            replace=args.replace, source_lang=source_lang, progress=not args.no_progress,
            checks=checks, drop=drop,
        )
    finally:
        translator.close()
        cache.close()
    write_manifest(records, out)
    report_path = out.with_name(out.name + ".report.json")
    report_path.write_text(json.dumps({lang: r.__dict__ for lang, r in reports.items()}, ensure_ascii=False,
                                      indent=1) + "\n", encoding="utf-8")
    sys.stderr.write(format_report(reports) + "\n")
    kept = {lang: sum(n - r.dropped[f] for f, n in r.counts.items()) for lang, r in reports.items()}
    if any(kept.values()):
        log.warning("flagged outputs written into the manifest (%s): examples in %s; --drop-flagged leaves them out",
                    ", ".join(f"{lang} {n}" for lang, n in kept.items() if n), report_path)
    log.info("wrote %d clips to %s (cache %s)", len(records), out, cache.path)
    return 0


def add_translate_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Add ``translate`` to the ``tonearm data`` subcommands (handler: :func:`cli_translate`)."""
    p = subparsers.add_parser("translate", help="machine-translate a manifest's English captions into other languages")
    p.add_argument("manifest", help="JSONL manifest with English (eng) captions")
    p.add_argument("--to", default=",".join(DEFAULT_TARGETS),
                   help="target languages, ISO 639-3, comma-separated (default: %(default)s)")
    p.add_argument("--out", required=True, help="JSONL manifest to write (the input's clips with the translations)")
    p.add_argument("--model", action="append", metavar="[LANG=]FOLDER",
                   help="local translation model: one many-to-many folder (M2M100, NLLB, MADLAD) or LANG=FOLDER "
                        "per target (Opus-MT pairs); a CTranslate2 folder (model.bin) runs on ctranslate2")
    p.add_argument("--endpoint", help="OpenAI-compatible base URL (…/v1) or full …/chat/completions URL")
    p.add_argument("--endpoint-model", help="model name sent to the endpoint")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY",
                   help="environment variable holding the endpoint's key (default: %(default)s)")
    p.add_argument("--concurrency", type=int, default=4, help="endpoint requests in flight (default: %(default)s)")
    p.add_argument("--retries", type=int, default=5, help="retries of a failed request (default: %(default)s)")
    p.add_argument("--retry-wait", type=float, default=1.0, help="first back-off in seconds, doubled each retry")
    p.add_argument("--batch-size", type=int, default=32,
                   help="captions per model batch or per endpoint request (default: %(default)s)")
    p.add_argument("--beams", type=int, default=1, help="beam size of local models (default: greedy)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="longest translation in tokens (default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device of local models, e.g. cuda (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads of local models")
    p.add_argument("--compute-type", default="default",
                   help="CTranslate2 folders: int8, int8_float32, float16, ... (default: as converted)")
    p.add_argument("--lang-code", action="append", metavar="LANG=CODE",
                   help="a language's code for the model (e.g. zho=zho_Hant), or its name for --endpoint "
                        "(e.g. fin=Finnish); needed for languages outside the built-in table")
    p.add_argument("--from", dest="source_lang", default=ENGLISH, help="source language (default: %(default)s)")
    p.add_argument("--cache", help="SQLite cache (default: OUT.cache.sqlite); rerun with it to resume")
    p.add_argument("--replace", action="store_true", help="replace translations the manifest already has")
    p.add_argument("--drop-flagged", nargs="?", const="all", default=None, metavar="FLAG,...",
                   help="leave flagged outputs out of the manifest: every flag, or those named (copied, wrong_script, "
                        "too_long); empty outputs are always left out")
    p.add_argument("--copy-similarity", type=float, default=Checks.copy_similarity,
                   help="flag 'copied' when an output is at least this similar to its English source "
                        "(difflib ratio, case and punctuation ignored; default %(default)s: identical)")
    p.add_argument("--min-script-share", type=float, default=Checks.min_script_share,
                   help="flag 'wrong_script' when less than this share of an output's letters are in the target's "
                        "script (jpn, zho, Latin and Cyrillic targets; default %(default)s)")
    p.add_argument("--max-length-ratio", type=float, default=Checks.max_length_ratio,
                   help=f"flag 'too_long' when an output has more than this many characters per source character "
                        f"(+ {LENGTH_SLACK}; default %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="no progress lines on stderr")
    p.set_defaults(handler=cli_translate)
    return p

