"""Fine-tuning from a real-size ``ClapModel`` starts exactly where the model stands (issue 32, SPEC §11).

The step-0 model is built as ``tonearm train configs/real/clap.yaml model.audio.path=FOLDER`` builds it
(``load_train_config`` → ``build_dual_encoder``) and compared with the **transformers model's own**
``ClapFeatureExtractor`` + ``get_audio_features`` / ``get_text_features`` (independent code, never
tonearm's front end): cosine ≥ 0.999 per item on clips of 0.5, 3, 10 and 14 s. The 14-s clip is cut to
its first 10-s window in eval (deterministic); the extractor is fed that window.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import ClapFeatureExtractor, ClapModel

from tests.real_size_models import PRESETS
from training.config import load_train_config
from training.models.dual_encoder import build_dual_encoder
from training.models.tokenizer import build_tokenizer

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test may build the session fixtures

RATE = 48000
SECONDS = (0.5, 3.0, 10.0, 14.0)


def signal(seconds: float, seed: int) -> np.ndarray:
    """A chirp plus noise (energy in every mel band)."""
    t = np.arange(int(seconds * RATE)) / RATE
    rng = np.random.default_rng(seed)
    chirp = np.sin(2 * np.pi * (200 + 2000 * t / seconds) * t)
    return (0.3 * chirp + 0.05 * rng.standard_normal(t.shape)).astype(np.float32)


def test_clap_finetune_step0_equals_the_pretrained_model(real_clap_dir: Path) -> None:
    cfg = load_train_config(PRESETS / "clap.yaml", [f"model.audio.path={real_clap_dir}"])
    tokenizer = build_tokenizer(cfg.model, [])
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size).eval()
    clap = ClapModel.from_pretrained(real_clap_dir).eval()
    extractor = ClapFeatureExtractor.from_pretrained(real_clap_dir)
    n = int(extractor.nb_max_samples)
    got, want = [], []
    with torch.no_grad():
        for i, seconds in enumerate(SECONDS):
            wave = signal(seconds, i)
            got.append(model.encode_audio(torch.from_numpy(wave)[None])[0])
            feats = extractor(wave[:n], sampling_rate=RATE, return_tensors="pt")["input_features"]
            want.append(clap.get_audio_features(input_features=feats).pooler_output[0])
        audio_cos = torch.nn.functional.cosine_similarity(torch.stack(got), torch.stack(want), dim=-1)
        texts = ["a dog barks twice", "un chien aboie", "犬が吠える"]
        ids, mask = (torch.from_numpy(a) for a in tokenizer.encode(texts))
        text_cos = torch.nn.functional.cosine_similarity(
            model.encode_text(ids, mask), clap.get_text_features(input_ids=ids, attention_mask=mask).pooler_output,
            dim=-1,
        )
    assert audio_cos.min() >= 0.999, dict(zip(SECONDS, audio_cos.tolist(), strict=True))
    assert text_cos.min() >= 0.999, text_cos.tolist()


def test_clap_finetune_data_path_pads_short_clips_as_the_extractor(real_clap_dir: Path, tmp_path: Path) -> None:
    """Short clips read from files by the training crop and the held-out evaluation windows (what
    ``tonearm train`` feeds the tower, not the tower alone) still give the model's own embedding:
    the data path repeat-pads them as ``ClapFeatureExtractor`` does instead of zero-padding (which
    gave cosines of 0.987–0.988 at step 0); a checkpoint bundle of this model records the padding."""
    import soundfile as sf

    from training.data.dataset import TrainClipDataset, eval_audio_chunks
    from training.data.manifest import ClipRecord
    from training.export import checkpoint_audio_frontend

    cfg = load_train_config(PRESETS / "clap.yaml", [f"model.audio.path={real_clap_dir}"])
    assert cfg.frontend.short_clip_padding == "repeatpad"
    assert checkpoint_audio_frontend(cfg) is not None
    tokenizer = build_tokenizer(cfg.model, [])
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size).eval()
    clap = ClapModel.from_pretrained(real_clap_dir).eval()
    extractor = ClapFeatureExtractor.from_pretrained(real_clap_dir)
    n = int(extractor.nb_max_samples)
    records = []
    for i, seconds in enumerate((0.5, 3.0)):
        sf.write(tmp_path / f"{i}.wav", signal(seconds, 10 + i), RATE, subtype="FLOAT")
        records.append(ClipRecord(id=str(i), audio=tmp_path / f"{i}.wav", captions={"eng": ["x"]}, split="train"))
    crops = TrainClipDataset(records, sample_rate=RATE, clip_samples=n, seed=0,
                             padding=cfg.frontend.short_clip_padding)
    with torch.no_grad():
        want = torch.stack([
            clap.get_audio_features(input_features=extractor(signal(s, 10 + i), sampling_rate=RATE,
                                                             return_tensors="pt")["input_features"]).pooler_output[0]
            for i, s in enumerate((0.5, 3.0))
        ])
        trained = model.encode_audio(torch.from_numpy(np.stack([crops[i].waveform for i in range(2)])))
        evaluated = model.encode_audio(torch.from_numpy(np.concatenate([
            eval_audio_chunks(r, sample_rate=RATE, clip_samples=n, policy=cfg.data.eval_crop,
                              padding=cfg.frontend.short_clip_padding) for r in records
        ])))
    for name, got in (("training crop", trained), ("evaluation window", evaluated)):
        cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
        assert cos.min() >= 0.999, (name, cos.tolist())


def test_ast_finetune_step0_equals_the_pretrained_model(real_ast_dir: Path) -> None:
    """The ``hf_ast`` tower of configs/real/ast_xlmr.yaml against ``ASTFeatureExtractor`` + ``ASTModel``
    (pooled output; the projection head is new) on 0.5, 3, 10 and 14-s clips at 16 kHz, each brought
    to the window by the data path (the resolved ``frontend.short_clip_padding``: AST's frame
    padding, issue 41; the 14-s clip's first window). Judged per item and on centred outputs (the
    set's mean removed: at random weights unrelated clips pool to nearly one vector)."""
    from transformers import ASTFeatureExtractor, ASTModel

    from index.audio import eval_chunks
    from training.config import short_clip_padding
    from training.evaluate import clip_samples
    from training.models.hf import build_hf_audio_tower

    cfg = load_train_config(PRESETS / "ast_xlmr.yaml", [f"model.audio.path={real_ast_dir}"])
    tower, _ = build_hf_audio_tower("hf_ast", path=str(real_ast_dir), frontend_cfg=cfg.frontend, config=None)
    tower.eval()
    model = ASTModel.from_pretrained(real_ast_dir).eval()
    extractor = ASTFeatureExtractor()  # the folder has no preprocessor_config.json: the defaults
    rate, n = int(extractor.sampling_rate), clip_samples(cfg.data, cfg.frontend)
    waves = [signal(s, i)[:: RATE // rate].copy() for i, s in enumerate(SECONDS)]
    fed = np.stack([eval_chunks(w, n, short_clip_padding(cfg.frontend))[0] for w in waves])  # type: ignore[arg-type]
    with torch.no_grad():
        got = tower(torch.from_numpy(fed))
        feats = extractor([w[:n] for w in waves], sampling_rate=rate, return_tensors="pt")["input_values"]
        torch.testing.assert_close(tower.frontend(torch.from_numpy(fed)), feats, rtol=1e-3, atol=2e-3)
        want = model(input_values=feats).pooler_output
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cos.min() >= 0.999, cos.tolist()
    centred = torch.nn.functional.cosine_similarity(got - got.mean(0), want - want.mean(0), dim=-1)
    assert centred.min() >= 0.99, centred.tolist()
