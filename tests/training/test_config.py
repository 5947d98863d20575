"""Config loading: presets, `extends`, dotted overrides, unknown keys."""

from __future__ import annotations

import pytest

from training.config import ConfigError, load_train_config


def test_extends_merges_sections_but_replaces_the_objective(tmp_path):
    (tmp_path / "parent.yaml").write_text(
        "optim: {epochs: 7, lr: 0.002}\n"
        "objective:\n  base: {name: infonce, tau: 0.05}\n  strategy: {name: random}\n"
    )
    (tmp_path / "child.yaml").write_text(
        "extends: parent.yaml\noptim: {epochs: 3}\nobjective:\n  base: {name: siglip}\n"
    )
    config = load_train_config(tmp_path / "child.yaml", ["optim.batch_size=16"])
    assert (config.optim.epochs, config.optim.lr, config.optim.batch_size) == (3, 0.002, 16)
    assert config.objective.base == {"name": "siglip"}  # no inherited tau
    assert config.objective.strategy == {"name": "random"}  # the default, not the parent's copy


def test_extends_cycle_and_missing_parent_are_clear_errors(tmp_path):
    (tmp_path / "a.yaml").write_text("extends: b.yaml\n")
    (tmp_path / "b.yaml").write_text("extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_train_config(tmp_path / "a.yaml")
    (tmp_path / "c.yaml").write_text("extends: nowhere.yaml\n")
    with pytest.raises(ConfigError, match="nowhere.yaml"):
        load_train_config(tmp_path / "c.yaml")


def test_unknown_key_is_named(tmp_path):
    (tmp_path / "x.yaml").write_text("optim: {epoch: 3}\n")
    with pytest.raises(ConfigError, match="unknown key 'optim.epoch'"):
        load_train_config(tmp_path / "x.yaml")
    with pytest.raises(ConfigError, match="unknown key 'model.audio.width'"):
        load_train_config(None, ["model.audio.width=3"])


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="key.path=value"):
        load_train_config(None, ["optim.lr"])


def test_override_typo_names_the_override_and_the_closest_key():
    with pytest.raises(ConfigError, match=r"^override 'optim.lrr=1': unknown key 'optim.lrr' \(did you mean optim.lr\?\)$"):
        load_train_config(None, ["optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"did you mean optim.lr\?"):
        load_train_config(None, ["optim.learning_rate=1"])
    with pytest.raises(ConfigError, match=r"did you mean optim.text.lr_scale\?"):
        load_train_config(None, ["optim.text.lr_scal=0.1"])
    with pytest.raises(ConfigError, match=r"did you mean optim.epochs\?"):
        load_train_config(None, ["epochs=3"])
    with pytest.raises(ConfigError, match=r"optim.lr: .*number.*\(override 'optim.lr=fast'\)"):
        load_train_config(None, ["optim.lr=fast"])
    # Free-form objective sections are the objective's to check.
    assert load_train_config(None, ["objective.base.tau=0.1"]).objective.base["tau"] == 0.1


def test_presets_do_not_pin_threads():
    from pathlib import Path

    presets = sorted(Path(__file__).resolve().parents[2].glob("configs/**/*.yaml"))
    assert presets
    for preset in presets:
        assert load_train_config(preset).threads is None, preset


def test_freeze_options_need_freeze_and_resume_excludes_overwrite():
    with pytest.raises(ConfigError, match="need freeze: true"):
        load_train_config(None, ["optim.text.unfrozen_layers=2"])
    with pytest.raises(ConfigError, match="resume and overwrite exclude each other"):
        load_train_config(None, ["resume=true", "overwrite=true"])


def test_short_clip_padding_auto_follows_the_audio_tower(tmp_path):
    """``frontend.short_clip_padding: auto`` resolves once: CLAP's extractor setting (its folder's
    preprocessor_config.json, else repeatpad); zeros for every other tower; an explicit value wins."""
    import json

    assert load_train_config(None).frontend.short_clip_padding == "pad"
    assert load_train_config(None, ["model.audio.kind=hf_clap"]).frontend.short_clip_padding == "repeatpad"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"padding": "repeat"}))
    clap = ["model.audio.kind=hf_clap", f"model.audio.path={tmp_path}"]
    assert load_train_config(None, clap).frontend.short_clip_padding == "repeat"
    assert load_train_config(None, [*clap, "frontend.short_clip_padding=pad"]).frontend.short_clip_padding == "pad"
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"padding": "mirror"}))
    with pytest.raises(ConfigError, match="mirror"):
        load_train_config(None, clap)
