"""Real-size Hugging Face models with random weights, saved locally once per test session (SPEC §11).

No weights can be downloaded here, so each architecture is built at its **full default
size** from a config written here and saved with ``save_pretrained`` — the folder a
user's real checkpoint would be, read by the same code:

* ``clap``: ``ClapModel(ClapConfig())`` (HTS-AT 27.5 M + RoBERTa-base 124.6 M) and a
  ``ClapProcessor``: ``ClapFeatureExtractor`` with laion/clap-htsat-unfused's settings
  (48 kHz, 64 mels, ``rand_trunc``, ``repeatpad``) + a RoBERTa byte-level BPE trained here
  (the model keeps RoBERTa's 50 265-row vocabulary; the tokenizer uses its first ids);
* ``ast``: ``ASTModel(ASTConfig())`` — AST-base (86 M, 128 mels × 1024 frames);
* ``xlmr``: ``XLMRobertaModel`` with xlm-roberta-base's config (278 M, vocab 250 002);
* ``minilm``: ``BertModel`` with paraphrase-multilingual-MiniLM-L12-v2's config
  (118 M: hidden 384, 12 layers, vocab 250 037);
* ``clap_text_roberta``: the ``clap`` folder's text tower saved as a plain ``RobertaModel``
  folder (:func:`save_clap_text_roberta`);
* ``pe_audio``: ``PeAudioModel(PeAudioConfig())`` (606 M: DAC-style codec encoder + 6-layer
  transformer 282 M, ModernBERT-large 321 M; ~34 s to create on 2 cores), its default
  ``PeAudioFeatureExtractor`` and a byte-level BPE trained here with ``[CLS]``-first ids.

The fixtures take each folder from the per-machine cache of tests/model_cache.py
(:func:`cached_model_dir`: built once per machine while :func:`model_key`'s inputs — the builder's
source, the seed, the library versions — are unchanged; ``TONEARM_TEST_CACHE``), and so do the
exports built from them (:func:`cached_export`: keyed also by the training/, index/ and tonearm/
code, configs/real/ and the manifests). A session sees each entry as a view under its base temp
dir (``base/real_models/NAME``), shared by every fixture that names it — in any conftest. Import
the fixtures into a conftest to use them. :func:`real_model_dir` is the uncached build into a
folder of the caller's (the benches, tests/bench/test_real_size_peers.py).
"""

from __future__ import annotations

import fcntl
import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import model_cache

os.environ.setdefault("HF_HUB_OFFLINE", "1")

CAPTIONS = [
    "a dog barks twice", "un chien aboie", "ein Hund bellt laut", "el perro ladra", "de hond blaft",
    "el gos borda", "犬が吠える", "狗在叫", "rain falls on a tin roof", "a siren passes by",
    "birds sing in the morning", "a car engine starts", "people talk in a busy cafe",
] * 8

XLMR_BASE: dict[str, Any] = {
    "vocab_size": 250002, "hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
    "max_position_embeddings": 514, "type_vocab_size": 1, "layer_norm_eps": 1e-5, "pad_token_id": 1, "bos_token_id": 0,
    "eos_token_id": 2,
}
"""xlm-roberta-base's config.json (architecture fields)."""
MINILM_L12_MULTILINGUAL: dict[str, Any] = {
    "vocab_size": 250037, "hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 1536,
    "max_position_embeddings": 512, "type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0,
}
"""sentence-transformers/paraphrase-multilingual-MiniLM-L12-v2's config.json (architecture fields)."""


def bpe_tokenizer(directory: Path, *, roberta_ids: bool, max_length: int) -> None:
    """A byte-level BPE trained here on :data:`CAPTIONS`, saved as a fast tokenizer.

    ``roberta_ids``: RoBERTa/XLM-R special ids (``<s>`` 0, ``<pad>`` 1, ``</s>`` 2, ``<unk>`` 3);
    else BERT-like (``<pad>`` 0).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"] if roberta_ids else ["<pad>", "<s>", "</s>", "<unk>", "<mask>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CAPTIONS, trainers.BpeTrainer(
        vocab_size=600, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    ))
    tok.post_processor = processors.RobertaProcessing(("</s>", int(tok.token_to_id("</s>"))),
                                                      ("<s>", int(tok.token_to_id("<s>"))))
    PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>",
        cls_token="<s>", sep_token="</s>", mask_token="<mask>", model_max_length=max_length,
    ).save_pretrained(directory)


def save_clap(directory: Path) -> None:
    from transformers import ClapConfig, ClapFeatureExtractor, ClapModel

    ClapModel(ClapConfig()).save_pretrained(directory)
    bpe_tokenizer(directory, roberta_ids=True, max_length=512)
    # laion/clap-htsat-unfused's preprocessor settings (the extractor's defaults but rand_trunc).
    ClapFeatureExtractor(truncation="rand_trunc", padding="repeatpad", frequency_min=50,
                         frequency_max=14000).save_pretrained(directory)


def save_ast(directory: Path) -> None:
    from transformers import ASTConfig, ASTModel

    ASTModel(ASTConfig()).save_pretrained(directory)


def save_xlmr(directory: Path) -> None:
    from transformers import XLMRobertaConfig, XLMRobertaModel

    XLMRobertaModel(XLMRobertaConfig(**XLMR_BASE)).save_pretrained(directory)
    bpe_tokenizer(directory, roberta_ids=True, max_length=512)


def save_minilm(directory: Path) -> None:
    from transformers import BertConfig, BertModel

    BertModel(BertConfig(**MINILM_L12_MULTILINGUAL)).save_pretrained(directory)
    bpe_tokenizer(directory, roberta_ids=False, max_length=128)


OPUS_MT_EN_DE: dict[str, Any] = {
    "vocab_size": 58101, "d_model": 512, "encoder_layers": 6, "decoder_layers": 6, "encoder_attention_heads": 8,
    "decoder_attention_heads": 8, "encoder_ffn_dim": 2048, "decoder_ffn_dim": 2048, "activation_function": "swish",
    "max_position_embeddings": 512, "pad_token_id": 58100, "decoder_start_token_id": 58100, "eos_token_id": 0,
    "scale_embedding": True, "static_position_embeddings": True, "normalize_before": False,
    "share_encoder_decoder_embeddings": True, "bad_words_ids": [[58100]],
}
"""Helsinki-NLP/opus-mt-en-de's config.json (architecture fields; 74 M parameters)."""


def save_marian(directory: Path, *, sentences: list[str] | None = None, pieces: int = 120,
                model_type: str = "unigram") -> None:
    """Opus-MT en-de at full size + a ``MarianTokenizer`` (SentencePiece trained here on :data:`CAPTIONS`).

    The model keeps Opus-MT's 58 101-row vocabulary (``<pad>`` 58100); ``vocab.json`` gives the
    trained pieces the first ids and names the others ``▁wN`` (words of their own when decoded).
    """
    import io
    import json

    import sentencepiece as spm
    from transformers import MarianConfig, MarianMTModel, MarianTokenizer

    MarianMTModel(MarianConfig(**OPUS_MT_EN_DE)).save_pretrained(directory)
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(sentences or CAPTIONS), model_writer=model, vocab_size=pieces,
                                   model_type=model_type,
                                   hard_vocab_limit=False, character_coverage=1.0, minloglevel=2)
    for name in ("source.spm", "target.spm"):
        (directory / name).write_bytes(model.getvalue())
    processor = spm.SentencePieceProcessor(model_proto=model.getvalue())
    vocab = {"</s>": 0, "<unk>": 1}
    for i in range(processor.get_piece_size()):
        vocab.setdefault(processor.id_to_piece(i), len(vocab))
    # Opus-MT's vocab.json names every id of the model (both languages' pieces): fill up to the pad id.
    for i in range(len(vocab), OPUS_MT_EN_DE["pad_token_id"]):
        vocab[f"▁w{i}"] = i
    vocab["<pad>"] = OPUS_MT_EN_DE["pad_token_id"]
    (directory / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    tokenizer = MarianTokenizer(str(directory / "source.spm"), str(directory / "target.spm"), str(directory / "vocab.json"),
                                source_lang="eng", target_lang="deu", model_max_length=512)
    tokenizer.save_pretrained(directory)


def save_pe_audio(directory: Path) -> None:
    import gc

    from transformers import PeAudioConfig, PeAudioFeatureExtractor, PeAudioModel

    model = PeAudioModel(PeAudioConfig())
    model.save_pretrained(directory)
    del model  # 2.4 GB: free it before the first user loads its own copy
    gc.collect()
    bpe_tokenizer(directory, roberta_ids=False, max_length=512)
    PeAudioFeatureExtractor().save_pretrained(directory)


CLAP_TEXT_BUFFERS = ("embeddings.position_ids", "embeddings.token_type_ids")
"""Persistent buffers of ``ClapTextModel`` that ``RobertaModel`` keeps non-persistent (an arange and zeros)."""


def save_clap_text_roberta(directory: Path, clap_dir: Path | None = None) -> None:
    """The text tower of the ``clap`` folder beside it (or of ``clap_dir``), saved as a plain ``RobertaModel`` folder.

    ``ClapTextModel`` is RoBERTa under another name: its weights load strictly into
    ``RobertaModel(RobertaConfig(**text_config))`` (only the two index buffers of
    :data:`CLAP_TEXT_BUFFERS` are dropped) and give the same hidden states. A server that
    embeds RoBERTa folders (Infinity's sentence-transformers path) then encodes whole queries,
    where its CLAP path cuts them to ``text_config.max_length``. The CLAP folder's tokenizer is
    copied with ``tokenizer_class`` ``PreTrainedTokenizerFast``, a name older transformers know too.
    """
    import json
    import shutil

    import torch
    from transformers import ClapModel, RobertaConfig, RobertaModel

    clap_dir = clap_dir or real_model_dir("clap", directory.parent.parent)
    clap = ClapModel.from_pretrained(clap_dir)
    state = clap.text_model.state_dict()
    for name in CLAP_TEXT_BUFFERS:
        expected = torch.arange(state[name].shape[-1]) if name.endswith("position_ids") else torch.zeros_like(state[name])
        if not torch.equal(state.pop(name).flatten(), expected.flatten().to(torch.long)):
            raise ValueError(f"{clap_dir}: {name} is not the buffer RobertaModel builds itself")
    text_config = clap.config.text_config.to_dict()
    model = RobertaModel(RobertaConfig(**text_config), add_pooling_layer=any(k.startswith("pooler.") for k in state))
    model.load_state_dict(state, strict=True)
    model.save_pretrained(directory)
    del clap, model
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (clap_dir / name).is_file():
            shutil.copyfile(clap_dir / name, directory / name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


BUILDERS: dict[str, Callable[..., None]] = {
    "pe_audio": save_pe_audio, "clap": save_clap, "ast": save_ast, "xlmr": save_xlmr, "minilm": save_minilm, "marian": save_marian,
    "clap_text_roberta": save_clap_text_roberta,
}


SEED = 0


def build_model(name: str, directory: Path, **kwargs: Any) -> None:
    """:data:`BUILDERS` ``[name]`` into ``directory`` from torch seed :data:`SEED` (what makes its bytes
    the same on every run: part of :func:`model_key`)."""
    import torch
    import transformers

    transformers.utils.logging.set_verbosity_error()
    torch.manual_seed(SEED)
    directory.mkdir(exist_ok=True)
    BUILDERS[name](directory, **kwargs)


def real_model_dir(name: str, base: Path) -> Path:
    """``base/real_models/NAME``, built by :data:`BUILDERS` on first use (seed 0), shared after (uncached:
    the benches' work folders; the test fixtures use :func:`cached_model_dir`)."""
    root = base / "real_models"
    root.mkdir(parents=True, exist_ok=True)
    directory, done = root / name, root / f"{name}.done"
    with (root / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            build_model(name, directory)
            done.touch()
    return directory


# ----------------------------------------------------------------------------- the per-machine cache

_BPE = [bpe_tokenizer, CAPTIONS]
MODEL_INPUTS: dict[str, tuple[list[Any], tuple[str, ...]]] = {
    "clap": ([save_clap, *_BPE], ("torch", "transformers", "tokenizers", "safetensors")),
    "ast": ([save_ast], ("torch", "transformers", "safetensors")),
    "xlmr": ([save_xlmr, XLMR_BASE, *_BPE], ("torch", "transformers", "tokenizers", "safetensors")),
    "minilm": ([save_minilm, MINILM_L12_MULTILINGUAL, *_BPE], ("torch", "transformers", "tokenizers", "safetensors")),
    "marian": ([save_marian, OPUS_MT_EN_DE, CAPTIONS], ("torch", "transformers", "sentencepiece", "safetensors")),
    "pe_audio": ([save_pe_audio, *_BPE], ("torch", "transformers", "tokenizers", "safetensors")),
    "clap_text_roberta": ([save_clap_text_roberta, CLAP_TEXT_BUFFERS], ("torch", "transformers", "safetensors")),
}
"""What decides each model folder's bytes besides the seed: the builder's source and the sources and
data it uses, and the libraries that write it."""
MODEL_DEPENDS = {"clap_text_roberta": "clap"}
"""A model built from another model's folder: its key includes that model's key."""


def model_inputs(name: str) -> dict[str, Any]:
    """What decides model NAME's bytes (its cache key's inputs): its :data:`MODEL_INPUTS` (sources by their
    text), :func:`build_model`'s source, the seed, the versions of the libraries it uses, and the key of
    the model it is built from."""
    sources, distributions = MODEL_INPUTS[name]
    depends = MODEL_DEPENDS.get(name)
    return {"model": name, "seed": SEED, "sources": [build_model, *sources],
            "versions": model_cache.versions(*distributions), "depends": {depends: model_key(depends)} if depends else {}}


@functools.cache
def model_key(name: str) -> str:
    """The cache key of model NAME (tests/model_cache.py): sha256 over :func:`model_inputs`."""
    return model_cache.key_of(**model_inputs(name))


def cache_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The per-machine cache (``$TONEARM_TEST_CACHE``, default ``~/.cache/tonearm/test-models``; ``off``: one
    under this session's base temp dir)."""
    return model_cache.cache_root(tmp_path_factory.getbasetemp() / "test-models")


def _cached_model(name: str, root: Path, view: Path | None = None) -> Path:
    """Model NAME's cache entry (``view``: a view of it there), built when missing."""
    def build(directory: Path) -> None:
        depends = MODEL_DEPENDS.get(name)
        if depends is None:
            build_model(name, directory)
            return
        # the folder it is built from, as a view beside the scratch dir (hard links: no copy, and a
        # concurrent prune of that entry cannot pull its files away mid-read)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{depends}-view-") as scratch:
            source = _cached_model(depends, root, Path(scratch) / depends)
            build_model(name, directory, **{f"{depends}_dir": source})

    return model_cache.cached(name, model_key(name), build, root=root, view=view, inputs=model_inputs(name))


def cached_model_dir(name: str, base: Path, *, root: Path) -> Path:
    """``base/real_models/NAME``: a view (tests/model_cache.py ``materialize``) of model NAME's entry in the
    cache ``root``, built there when its :func:`model_key` has none; made once per ``base``."""
    views = base / "real_models"
    views.mkdir(parents=True, exist_ok=True)
    directory, done = views / name, views / f"{name}.done"
    with (views / f"{name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _cached_model(name, root, directory)
            done.touch()
    return directory


@functools.cache
def code_digest() -> str:
    """sha256 of the code and configs an export's bytes come from: training/, index/ and tonearm/
    (*.py) and configs/default.yaml + configs/real/*.yaml (the presets extend default.yaml)."""
    return model_cache.tree_digest(PRESETS.parents[1], ["training/**/*.py", "index/**/*.py", "tonearm/**/*.py",
                                                        "configs/default.yaml", "configs/real/*.yaml"])


EXPORT_DISTRIBUTIONS = ("torch", "transformers", "tokenizers", "sentencepiece", "safetensors", "numpy", "scipy",
                        "onnx", "onnxruntime", "faiss-cpu", "soundfile", "soxr")
"""The libraries whose versions an export's (or a training run's) output may depend on."""


def cached_export(name: str, build: Callable[[Path], None], tmp_path_factory: pytest.TempPathFactory, *,
                  models: Iterable[str], manifests: Iterable[Path], sources: Iterable[Any] = ()) -> Path:
    """A view (under the session's base temp dir) of the cache entry NAME that ``build(directory)`` fills
    (a training run, bundles), rebuilt when any input of its key changes: ``build``'s own source and
    ``sources``, the keys of the ``models`` it reads, the ``manifests``' contents (audio by content),
    :func:`code_digest` and :data:`EXPORT_DISTRIBUTIONS`' versions. Keyed by the code, the export code
    still runs whenever it changed: a test of the export keeps guarding it."""
    inputs = {"name": name, "sources": [build, *sources], "models": {m: model_key(m) for m in sorted(set(models))},
              "manifests": [model_cache.manifest_digest(m) for m in manifests], "code": code_digest(),
              "versions": model_cache.versions(*EXPORT_DISTRIBUTIONS)}
    key = model_cache.key_of(**inputs)
    return model_cache.cached(name, key, build, root=cache_root(tmp_path_factory), inputs=inputs,
                              view=tmp_path_factory.getbasetemp() / name)


def _fixture(name: str) -> Callable[[pytest.TempPathFactory], Path]:
    def build(tmp_path_factory: pytest.TempPathFactory) -> Path:
        return cached_model_dir(name, tmp_path_factory.getbasetemp(), root=cache_root(tmp_path_factory))

    build.__name__ = f"real_{name}_dir"
    build.__doc__ = (f"Folder of the real-size random-weight {name!r} model (tests/real_size_models.py), from the "
                     "per-machine cache (tests/model_cache.py).")
    return pytest.fixture(scope="session")(build)


real_clap_dir = _fixture("clap")
real_ast_dir = _fixture("ast")
real_xlmr_dir = _fixture("xlmr")
real_minilm_dir = _fixture("minilm")
real_marian_dir = _fixture("marian")


# ----------------------------------------------------------------------------- data and bundles

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "real"
PRESET_MODELS: dict[str, dict[str, str]] = {
    "clap": {"model.audio.path": "clap"},
    "ast_xlmr": {"model.audio.path": "ast", "model.text.path": "xlmr"},
    "minilm": {"model.text.path": "minilm"},
}
"""configs/real/NAME.yaml → the overrides naming the real-size model folders it needs."""


def mini_manifest(corpus_manifest: Path, out: Path, per_split: int = 2, *, train: int | None = None) -> Path:
    """The first ``per_split`` clips of each split of a corpus (real-size encoders cost ~1 s per clip);
    ``train``: another number of training clips."""
    from index.languages import DEFAULT_LANGUAGES
    from training.data.manifest import load_manifest, write_manifest

    records = load_manifest(corpus_manifest, languages=DEFAULT_LANGUAGES)
    counts = {"train": per_split if train is None else train, "val": per_split, "test": per_split}
    chosen = [r for split, n in counts.items() for r in [x for x in records if x.split == split][:n]]
    write_manifest(chosen, out)
    return out


@pytest.fixture(scope="session")
def real_manifest(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Six clips of the tiny corpus (2 train, 2 val, 2 test; 2–4 s at 16 kHz, 8 languages)."""
    return mini_manifest(tiny_corpus, tmp_path_factory.mktemp("real_manifest") / "manifest.jsonl")


@pytest.fixture(scope="session")
def real_train_manifest(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`real_manifest` with four training clips: the presets' two steps of batch 2 in one
    epoch, so the run saves ``last/`` (weights + AdamW state, ~4.4 GB for ast_xlmr, fsync'd) once
    instead of once per one-step epoch."""
    return mini_manifest(tiny_corpus, tmp_path_factory.mktemp("real_train_manifest") / "manifest.jsonl", train=4)


def only_bundle(bundles: Path) -> Path:
    """The one bundle directory in ``bundles`` (a service started over it adds ``.items`` beside it)."""
    (bundle,) = [p for p in bundles.iterdir() if p.is_dir() and not p.name.startswith(".")]
    return bundle


@pytest.fixture(scope="session")
def real_clap_pretrained_bundle(real_clap_dir: Path, real_manifest: Path,
                                tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tonearm export --pretrained` of the real-size CLAP folder over :func:`real_manifest` (48 kHz).

    Cached per machine (:func:`cached_export`): exported again whenever the export code, the CLAP
    folder's key, the manifest or a library changes; otherwise the bundle of an earlier run. Its
    parent holds only it (the service tests name it as their bundles directory)."""
    from training.bundle.pretrained import export_pretrained_bundle

    def build(directory: Path) -> None:
        export_pretrained_bundle(real_clap_dir, manifest=real_manifest, out_dir=directory / "bundles", progress=False)

    view = cached_export("clap_pretrained_bundle", build, tmp_path_factory, models=["clap"], manifests=[real_manifest])
    return only_bundle(view / "bundles")


def train_preset(name: str, model_dirs: dict[str, Path], manifest: Path, out_dir: Path, *, epochs: int = 2) -> Path:
    """configs/real/NAME.yaml trained for ``epochs`` epochs of batch 2 (no weight decay, fp32) on CPU,
    validated after the last: two steps over a manifest with two training clips, or one epoch
    over four (:func:`real_train_manifest`)."""
    from training.config import load_train_config
    from training.loop import train

    overrides = [f"{key}={model_dirs[model]}" for key, model in PRESET_MODELS[name].items()]
    overrides += [
        f"data.manifest={manifest}", f"out_dir={out_dir}", "device=cpu", "threads=2", f"optim.epochs={epochs}",
        "optim.batch_size=2", "optim.warmup_steps=0", "optim.weight_decay=0.0", "optim.amp=false",
        f"eval.every_epochs={epochs}", "eval.batch_size=2", "data.num_workers=0",
    ]
    return train(load_train_config(PRESETS / f"{name}.yaml", overrides))


@dataclass(frozen=True)
class PresetRun:
    """A real-size preset trained two steps and exported (session fixtures ``real_<preset>_run``)."""

    name: str
    run_dir: Path
    checkpoint: Path
    """The checkpoint the bundle was exported from (its optimizer state and the other copy are deleted)."""
    bundle: Path
    model_dirs: dict[str, Path]


def _preset_fixture(name: str) -> Callable[..., PresetRun]:
    def fixture(request: pytest.FixtureRequest, real_manifest: Path, real_train_manifest: Path,
                tmp_path_factory: pytest.TempPathFactory) -> PresetRun:
        from training.bundle.export import export_bundle

        dirs = {model: request.getfixturevalue(f"real_{model}_dir") for model in PRESET_MODELS[name].values()}

        def build(directory: Path) -> None:
            # two steps of batch 2 in one epoch (the same steps as two one-clip-pair epochs, one `last/` save)
            run = train_preset(name, dirs, real_train_manifest, directory / "run", epochs=1)
            checkpoint = run / "best" if (run / "best").is_dir() else run / "last"
            export_bundle(checkpoint, manifest=real_manifest, out_dir=directory / "bundles", progress=False)
            if checkpoint.name == "best":  # `last/` holds the same weights plus the optimizer: 4.2 GB for ast_xlmr
                shutil.rmtree(run / "last")

        view = cached_export(f"real_{name}_run", build, tmp_path_factory, models=list(dirs),
                             manifests=[real_manifest, real_train_manifest], sources=[train_preset, PRESET_MODELS[name]])
        run = view / "run"
        checkpoint = run / "best" if (run / "best").is_dir() else run / "last"
        bundle = only_bundle(view / "bundles")
        return PresetRun(name=name, run_dir=run, checkpoint=checkpoint, bundle=bundle, model_dirs=dirs)

    fixture.__name__ = f"real_{name}_run"
    fixture.__doc__ = (
        f"configs/real/{name}.yaml at real size: two training steps, then `tonearm export`.\n\n"
        "The training run and the bundle are cached together per machine (:func:`cached_export`; the tests read\n"
        "the run's metrics.jsonl and checkpoint weights and the bundle, nothing else of the run): trained and\n"
        "exported again whenever the training/, index/ or tonearm/ code, a configs/real/ or the default config,\n"
        "a model's key, the manifests or a library changes — so the tests of training and export still run that\n"
        "code after every change to it — and read from an earlier run otherwise.")
    return pytest.fixture(scope="session")(fixture)


real_clap_run = _preset_fixture("clap")
real_ast_xlmr_run = _preset_fixture("ast_xlmr")
real_minilm_run = _preset_fixture("minilm")
