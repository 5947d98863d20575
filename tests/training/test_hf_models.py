"""Hugging Face towers from tiny random models saved locally (no hub access, SPEC §3)."""

from __future__ import annotations

import os

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never reach the hub

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers
from transformers import (
    ASTConfig,
    ASTModel,
    BertConfig,
    BertModel,
    ClapConfig,
    ClapModel,
    PreTrainedTokenizerFast,
    Wav2Vec2Config,
    Wav2Vec2Model,
    WhisperConfig,
    WhisperModel,
)

from training.bundle.onnx_export import export_audio_encoder, export_text_encoder, onnx_session
from training.checkpoint import load_checkpoint, save_checkpoint
from training.config import (
    AudioTowerConfig,
    ConfigError,
    FrontendConfig,
    ModelConfig,
    TextTowerConfig,
    TrainConfig,
)
from training.models.dual_encoder import DualEncoder, build_dual_encoder
from training.models.tokenizer import build_tokenizer

FRONTEND = FrontendConfig(n_mels=16)
TEXTS = [
    "a dog barks",
    "un chien aboie",
    "ein Hund bellt",
    "狗在叫",
    "犬が吠える",
    "rain then a siren",
] * 4


def wordpiece_tokenizer(directory: Path) -> PreTrainedTokenizerFast:
    """A tiny BERT-style fast tokenizer trained here, saved with save_pretrained."""
    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(
        TEXTS, trainers.WordPieceTrainer(vocab_size=120, special_tokens=specials)
    )
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    )
    fast.save_pretrained(directory)
    return fast


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny random BERT, AST, CLAP, wav2vec 2.0 and Whisper saved with save_pretrained."""
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    torch.manual_seed(0)
    root = tmp_path_factory.mktemp("hf")
    dirs = {name: root / name for name in ("bert", "ast", "clap", "w2v", "whisper")}
    fast = wordpiece_tokenizer(dirs["bert"])
    small = {"num_attention_heads": 2, "intermediate_size": 64}
    BertModel(
        BertConfig(
            vocab_size=len(fast),
            hidden_size=32,
            num_hidden_layers=2,
            max_position_embeddings=64,
            **small,
        )
    ).save_pretrained(dirs["bert"])
    ASTModel(
        ASTConfig(hidden_size=32, num_hidden_layers=1, max_length=100, num_mel_bins=16, **small)
    ).save_pretrained(dirs["ast"])
    clap = ClapConfig(
        text_config={
            "vocab_size": len(fast),
            "hidden_size": 32,
            "num_hidden_layers": 1,
            "max_position_embeddings": 70,
            "pad_token_id": 0,
            "projection_dim": 16,
            **small,
        },
        audio_config={
            "spec_size": 64,
            "num_mel_bins": 16,
            "window_size": 4,
            "patch_size": 4,
            "patch_stride": (4, 4),
            "patch_embeds_hidden_size": 16,
            "depths": [1, 1],
            "num_attention_heads": [1, 2],
            "hidden_size": 32,
            "projection_dim": 16,
        },
        projection_dim=16,
    )
    ClapModel(clap).save_pretrained(dirs["clap"])
    fast.save_pretrained(dirs["clap"])
    Wav2Vec2Model(
        Wav2Vec2Config(
            hidden_size=32,
            num_hidden_layers=1,
            conv_dim=(16, 16),
            conv_stride=(5, 4),
            conv_kernel=(10, 8),
            num_conv_pos_embeddings=16,
            num_conv_pos_embedding_groups=2,
            **small,
        )
    ).save_pretrained(dirs["w2v"])
    WhisperModel(
        WhisperConfig(
            d_model=32,
            encoder_layers=1,
            decoder_layers=1,
            encoder_attention_heads=2,
            decoder_attention_heads=2,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_mel_bins=16,
            max_source_positions=50,
            max_target_positions=16,
            vocab_size=100,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=2,
            decoder_start_token_id=1,
        )
    ).save_pretrained(dirs["whisper"])
    return dirs


def config(
    audio: tuple[str, Path | None], text: tuple[str, Path | None], **text_extra: object
) -> ModelConfig:
    return ModelConfig(
        embed_dim=16,
        audio=AudioTowerConfig(
            kind=audio[0], path=str(audio[1]) if audio[1] else None, dropout=0.0
        ),
        text=TextTowerConfig(
            kind=text[0],
            path=str(text[1]) if text[1] else None,
            max_length=16,
            dropout=0.0,
            **text_extra,
        ),
    )


def one_training_step(model: DualEncoder, cfg: ModelConfig, seconds: float = 1.0) -> None:
    """Forward + backward + SGD step; every tower gets gradients and embeddings are unit vectors."""
    tokenizer = build_tokenizer(cfg, TEXTS)
    ids, mask = (torch.from_numpy(a) for a in tokenizer.encode(TEXTS[:3]))
    model.train()
    audio, text = model(0.1 * torch.randn(3, int(16000 * seconds)), ids, mask)
    assert audio.shape == text.shape == (3, 16)
    torch.testing.assert_close(audio.norm(dim=-1), torch.ones(3))
    logits = audio @ text.T / 0.07
    loss = torch.nn.functional.cross_entropy(logits, torch.arange(3))
    loss.backward()
    for part in (model.audio, model.text):
        assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in part.tower.parameters())
    torch.optim.SGD(model.parameters(), lr=0.1).step()


def test_text_tokenizer_from_the_model_dir_matches_transformers(hf_dirs: dict[str, Path]) -> None:
    cfg = config(("cnn", None), ("hf_auto", hf_dirs["bert"]))
    ours = build_tokenizer(cfg, [])
    reference = PreTrainedTokenizerFast.from_pretrained(hf_dirs["bert"])
    texts = [*TEXTS[:6], " ".join(TEXTS)]
    expected = reference(
        texts, padding="max_length", truncation=True, max_length=16, return_tensors="np"
    )
    ids, mask = ours.encode(texts)
    np.testing.assert_array_equal(ids, expected["input_ids"])
    np.testing.assert_array_equal(mask, expected["attention_mask"])


@pytest.mark.parametrize("pooling", ["mean", "cls"])
def test_bert_text_and_ast_audio_train(hf_dirs: dict[str, Path], pooling: str) -> None:
    cfg = config(("hf_ast", hf_dirs["ast"]), ("hf_auto", hf_dirs["bert"]), pooling=pooling)
    tokenizer = build_tokenizer(cfg, TEXTS)
    model = build_dual_encoder(cfg, FRONTEND, vocab_size=tokenizer.vocab_size)
    seen: list[tuple[int, ...]] = []
    model.audio.tower.model.register_forward_pre_hook(
        lambda _m, args, kwargs: seen.append(tuple(kwargs["input_values"].shape)), with_kwargs=True
    )
    one_training_step(model, cfg, seconds=1.0)
    one_training_step(model, cfg, seconds=3.0)  # longer than max_length frames: cropped
    assert seen == [(3, 100, 16), (3, 100, 16)]


def test_clap_pair_keeps_the_pretrained_joint_space(hf_dirs: dict[str, Path]) -> None:
    """Identity-initialised heads: our embeddings equal CLAP's own normalised features."""
    cfg = config(("hf_clap", hf_dirs["clap"]), ("hf_clap", None))
    tokenizer = build_tokenizer(cfg, [])
    model = build_dual_encoder(cfg, FRONTEND, vocab_size=tokenizer.vocab_size).eval()
    clap = ClapModel.from_pretrained(hf_dirs["clap"]).eval()
    ids, mask = (torch.from_numpy(a) for a in tokenizer.encode(TEXTS[:4]))
    wave = 0.1 * torch.randn(2, 16000)
    # The reference is transformers' own extractor (independent of tonearm's front end), at the
    # settings the tower takes when the folder has no preprocessor_config.json: FRONTEND's.
    extractor = transformers.ClapFeatureExtractor(
        feature_size=FRONTEND.n_mels, sampling_rate=FRONTEND.sample_rate, hop_length=FRONTEND.hop_length,
        fft_window_size=FRONTEND.n_fft, frequency_min=FRONTEND.f_min, frequency_max=FRONTEND.f_max,
        truncation="rand_trunc", padding="repeatpad", max_length_s=2,
    )
    with torch.no_grad():
        text_ref = clap.get_text_features(input_ids=ids, attention_mask=mask).pooler_output
        feats = extractor(list(wave.numpy()), sampling_rate=FRONTEND.sample_rate, return_tensors="pt")
        audio_ref = clap.get_audio_features(input_features=feats["input_features"]).pooler_output
        torch.testing.assert_close(model.encode_text(ids, mask), text_ref, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.encode_audio(wave), audio_ref, rtol=1e-4, atol=1e-5)
    one_training_step(model, cfg)


@pytest.mark.parametrize("name", ["w2v", "whisper"])
def test_auto_audio_backbones_train(hf_dirs: dict[str, Path], name: str) -> None:
    cfg = config(("hf_auto", hf_dirs[name]), ("builtin", None))
    tokenizer = build_tokenizer(cfg, TEXTS)
    one_training_step(build_dual_encoder(cfg, FRONTEND, vocab_size=tokenizer.vocab_size), cfg)


def test_configuration_errors_name_the_key(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="frontend.n_mels=64"):
        build_dual_encoder(
            config(("hf_ast", hf_dirs["ast"]), ("builtin", None)), FrontendConfig(), vocab_size=50
        )
    with pytest.raises(ConfigError, match="model.audio.path"):
        build_dual_encoder(config(("hf_ast", None), ("builtin", None)), FRONTEND, vocab_size=50)
    with pytest.raises(ConfigError, match="kind=hf_ast"):
        build_dual_encoder(
            config(("hf_auto", hf_dirs["ast"]), ("builtin", None)), FRONTEND, vocab_size=50
        )
    with pytest.raises(ConfigError, match="model.text.path"):
        build_dual_encoder(
            config(("cnn", None), ("hf_auto", tmp_path / "missing")), FRONTEND, vocab_size=50
        )


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize(
    ("audio", "text"),
    [(("hf_ast", "ast"), ("hf_auto", "bert")), (("hf_clap", "clap"), ("hf_clap", None))],
)
def test_onnx_export_parity(
    hf_dirs: dict[str, Path], tmp_path: Path, audio: tuple[str, str], text: tuple[str, str | None]
) -> None:
    cfg = config((audio[0], hf_dirs[audio[1]]), (text[0], hf_dirs[text[1]] if text[1] else None))
    tokenizer = build_tokenizer(cfg, TEXTS)
    model = build_dual_encoder(cfg, FRONTEND, vocab_size=tokenizer.vocab_size).eval()
    audio_path = export_audio_encoder(
        model.audio_module(), tmp_path / "audio.onnx", sample_rate=16000
    )
    text_path = export_text_encoder(model.text_module(), tmp_path / "text.onnx", max_length=16)
    wave = 0.1 * np.random.default_rng(0).standard_normal((3, 24000)).astype(np.float32)
    with torch.no_grad():
        expected = model.encode_audio(torch.from_numpy(wave)).numpy()
    assert (
        cosines(onnx_session(audio_path).run(None, {"waveform": wave})[0], expected).min() >= 0.999
    )
    ids, mask = tokenizer.encode(TEXTS[:5])
    for length in (16, 9):  # dynamic token axis
        feeds = {"input_ids": ids[:, :length], "attention_mask": mask[:, :length]}
        with torch.no_grad():
            expected = model.text_module()(*(torch.from_numpy(v) for v in feeds.values())).numpy()
        assert cosines(onnx_session(text_path).run(None, feeds)[0], expected).min() >= 0.999


def test_checkpoint_loads_without_the_original_model_dirs(
    hf_dirs: dict[str, Path], tmp_path: Path
) -> None:
    copies = {name: shutil.copytree(hf_dirs[name], tmp_path / name) for name in ("ast", "bert")}
    cfg = TrainConfig(
        frontend=FRONTEND, model=config(("hf_ast", copies["ast"]), ("hf_auto", copies["bert"]))
    )
    tokenizer = build_tokenizer(cfg.model, [])
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size).eval()
    out = save_checkpoint(tmp_path / "ckpt", model=model, config=cfg, tokenizer=tokenizer)
    for path in copies.values():
        shutil.rmtree(path)
    loaded = load_checkpoint(out)
    ids, mask = (torch.from_numpy(a) for a in tokenizer.encode(TEXTS[:3]))
    wave = 0.1 * torch.randn(2, 16000)
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.model.encode_text(ids, mask), model.encode_text(ids, mask)
        )
        torch.testing.assert_close(loaded.model.encode_audio(wave), model.encode_audio(wave))


def test_model_loading_errors_are_one_line_naming_the_folder(hf_dirs: dict[str, Path], tmp_path: Path) -> None:
    """A missing folder, a folder without config.json or weights, a tokenizer that cannot load."""
    def text_cfg(path: Path | str) -> ModelConfig:
        return config(("cnn", None), ("hf_auto", Path(path)))

    no_config = tmp_path / "no_config"
    shutil.copytree(hf_dirs["bert"], no_config)
    (no_config / "config.json").unlink()
    no_weights = tmp_path / "no_weights"
    shutil.copytree(hf_dirs["bert"], no_weights)
    (no_weights / "model.safetensors").unlink()
    no_tokenizer = tmp_path / "no_tokenizer"
    shutil.copytree(hf_dirs["bert"], no_tokenizer)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        (no_tokenizer / name).unlink(missing_ok=True)
    broken_tokenizer = tmp_path / "broken_tokenizer"
    shutil.copytree(hf_dirs["bert"], broken_tokenizer)
    (broken_tokenizer / "tokenizer.json").write_text("{not json")
    cases = [
        (lambda: build_dual_encoder(text_cfg(tmp_path / "nowhere"), FRONTEND, vocab_size=50),
         f"model.text.path: model folder {tmp_path / 'nowhere'} does not exist"),
        (lambda: build_tokenizer(text_cfg(tmp_path / "nowhere"), []),
         f"model.text.path: model folder {tmp_path / 'nowhere'} does not exist"),
        (lambda: build_dual_encoder(text_cfg(no_config), FRONTEND, vocab_size=50),
         f"model.text.path: no config.json in {no_config}"),
        (lambda: build_dual_encoder(text_cfg(no_weights), FRONTEND, vocab_size=50),
         f"model.text.path: no weights in {no_weights} (expected one of model.safetensors"),
        (lambda: build_tokenizer(text_cfg(no_tokenizer), []),
         f"model.text.path: no tokenizer in {no_tokenizer} (expected tokenizer.json"),
        (lambda: build_tokenizer(text_cfg(broken_tokenizer), []),
         f"model.text.path '{broken_tokenizer}': its tokenizer cannot be loaded: "),
        (lambda: build_dual_encoder(config(("hf_ast", tmp_path / "nowhere"), ("builtin", None)), FRONTEND, vocab_size=50),
         f"model.audio.path: model folder {tmp_path / 'nowhere'} does not exist"),
    ]
    for build, message in cases:
        with pytest.raises(ConfigError) as caught:
            build()
        assert str(caught.value).startswith(message), str(caught.value)
        assert "\n" not in str(caught.value)


def test_gradient_checkpointing_gives_the_same_gradients(hf_dirs: dict[str, Path]) -> None:
    from training.finetune import enable_gradient_checkpointing, is_checkpointing

    cfg = config(("cnn", None), ("hf_auto", hf_dirs["bert"]))
    train_cfg = TrainConfig(model=cfg, frontend=FRONTEND)
    tokenizer = build_tokenizer(cfg, TEXTS)
    ids, mask = (torch.from_numpy(a) for a in tokenizer.encode(TEXTS[:4]))
    gradients = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = build_dual_encoder(cfg, FRONTEND, vocab_size=50).train()
        if checkpointing:
            enable_gradient_checkpointing(model, train_cfg.model_copy(update={"optim": train_cfg.optim.model_copy(
                update={"text": train_cfg.optim.text.model_copy(update={"gradient_checkpointing": True})})}))
            assert is_checkpointing(model.text.tower.model)
        model.encode_text(ids, mask).square().sum().backward()
        gradients.append({n: p.grad.clone() for n, p in model.text.named_parameters() if p.grad is not None})
    assert gradients[0].keys() == gradients[1].keys() and gradients[0]
    for name, grad in gradients[0].items():
        torch.testing.assert_close(grad, gradients[1][name], msg=name)
    builtin = TrainConfig(frontend=FRONTEND).model_copy()
    builtin.optim.text.gradient_checkpointing = True
    model = build_dual_encoder(builtin.model, FRONTEND, vocab_size=300)
    enable_gradient_checkpointing(model, builtin)  # the built-in transformer checkpoints its blocks
    assert model.text.tower.checkpoint_blocks  # (test_activation_checkpointing.py)
