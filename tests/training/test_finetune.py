"""Fine-tuning controls: per-tower learning rate / weight decay groups, freezing and unfreezing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import TINY_CONFIG
from training.config import ConfigError, load_train_config
from training.finetune import apply_freezing, layer_stack, parameter_groups
from training.loop import TrainStep, train
from training.models.dual_encoder import build_dual_encoder
from training.objectives import build_objective
from training.objectives.base import BuildEnv


def _model_and_step(*overrides: str):  # noqa: ANN202
    cfg = load_train_config(TINY_CONFIG, list(overrides))
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=300)
    objective = build_objective(cfg.objective, BuildEnv(languages=tuple(cfg.data.languages), embed_dim=model.embed_dim))
    return cfg, model, TrainStep(model, objective)


def test_groups_scale_the_learning_rate_and_decay_per_tower() -> None:
    cfg, model, step = _model_and_step("optim.text.lr_scale=0.1", "optim.audio.weight_decay=0.05")
    groups = {g["name"]: g for g in parameter_groups(step, model, cfg)}
    assert set(groups) == {f"{t}.{d}" for t in ("audio", "text", "head") for d in ("decay", "no_decay")}
    everything = [id(p) for p in step.parameters()]
    grouped = [id(p) for g in groups.values() for p in g["params"]]
    assert sorted(grouped) == sorted(everything)  # each parameter exactly once
    assert {id(p) for p in model.text.tower.parameters()} == {
        id(p) for name in ("text.decay", "text.no_decay") for p in groups[name]["params"]
    }
    assert [g["lr_scale"] for g in groups.values()] == [1.0, 1.0, 0.1, 0.1, 1.0, 1.0]
    assert groups["audio.decay"]["weight_decay"] == 0.05 and groups["text.decay"]["weight_decay"] == cfg.optim.weight_decay
    # Biases, norm weights and the temperature τ never decay.
    for name in ("audio.no_decay", "text.no_decay", "head.no_decay"):
        assert groups[name]["weight_decay"] == 0.0 and all(p.ndim < 2 for p in groups[name]["params"])
    tau = [p for p in step.objective.parameters() if p.ndim == 0]
    assert tau and all(any(p is t for p in groups["head.no_decay"]["params"]) for t in tau)


def test_unfrozen_layers_are_the_last_blocks_and_what_follows() -> None:
    cfg, model, _ = _model_and_step("model.text.layers=3", "optim.text.freeze=true", "optim.text.unfrozen_layers=1")
    apply_freezing(model, cfg, epoch=0)
    text = model.text.tower
    assert layer_stack(text) is text.blocks
    trainable = {name for name, p in text.named_parameters() if p.requires_grad}
    assert trainable == {n for n, _ in text.named_parameters() if n.startswith(("blocks.2.", "norm."))}
    assert all(p.requires_grad for p in model.audio.parameters()) and all(p.requires_grad for p in model.text.head.parameters())
    bad = load_train_config(TINY_CONFIG, ["optim.text.freeze=true", "optim.text.unfrozen_layers=4"])
    with pytest.raises(ConfigError, match="optim.text.unfrozen_layers=4: TextTransformer has only 3 layers"):
        apply_freezing(model, bad, epoch=0)


def test_frozen_towers_stay_put_until_unfrozen(tiny_corpus: Path, tiny_checkpoint: Path, tmp_path: Path) -> None:
    """From the tiny checkpoint: audio frozen throughout (BatchNorm statistics included); text frozen but
    its last layer for epoch 1, all of it from epoch 2."""
    overrides = [
        f"data.manifest={tiny_corpus}", f"out_dir={tmp_path}", f"model.init_checkpoint={tiny_checkpoint}",
        "optim.epochs=2", "optim.batch_size=4", "data.max_clips=8", "optim.warmup_steps=0", "eval.every_epochs=2",
        "optim.audio.freeze=true", "optim.text.freeze=true", "optim.text.unfrozen_layers=1",
        "optim.text.unfreeze_after_epochs=1",
    ]
    start = load_file(str(tiny_checkpoint / "model.safetensors"))
    train(load_train_config(TINY_CONFIG, overrides), interrupt_after_steps=2)  # the end of epoch 1

    def changed() -> set[str]:
        now = load_file(str(tmp_path / "last" / "model.safetensors"))
        return {k for k, v in now.items() if not (v == start[k]).all()}

    after_epoch_1 = changed()
    assert not {k for k in after_epoch_1 if k.startswith("audio.tower.")}  # weights and BN running stats
    assert "audio.head.linear.weight" in after_epoch_1 and "text.tower.blocks.0.attn.qkv.weight" in after_epoch_1
    assert "text.tower.norm.weight" in after_epoch_1
    assert not {k for k in after_epoch_1 if k.startswith(("text.tower.token_emb", "text.tower.pos_emb"))}
    train(load_train_config(TINY_CONFIG, [*overrides, "resume=true"]))
    after_epoch_2 = changed()
    assert {"text.tower.token_emb.weight", "text.tower.pos_emb"} <= after_epoch_2
    assert not {k for k in after_epoch_2 if k.startswith("audio.tower.")}
    saved = json.loads((tmp_path / "last" / "trainer_state.json").read_text())["optimizer"]["param_groups"]
    assert {g["name"] for g in saved} >= {"audio.decay", "text.no_decay", "head.decay"}
