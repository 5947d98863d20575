"""configs/real/*: each real-size preset at its full default size (random weights, saved here) trains,
exports with ONNX parity and answers through the service (SPEC §11).

One session fixture per preset (tests/real_size_models.py) trains two steps — batch 2, no weight
decay, so a tower's weights move only if gradients reached it — and exports once; every test
here reads that run and bundle.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from index.runtime.verify import verify_bundle
from tests.real_size_models import PresetRun

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]  # the first test builds the session fixtures

PRESETS = ["clap", "ast_xlmr", "minilm"]
TOWER_PREFIXES = {"audio": "audio.tower.", "text": "text.tower."}
BACKBONES = {
    # (preset, tower) → (key prefix in our checkpoint, model folder, key prefix in its loaded state dict)
    ("clap", "audio"): ("audio.tower.audio_model.", "clap", "audio_model."),
    ("clap", "text"): ("text.tower.text_model.", "clap", "text_model."),
    ("ast_xlmr", "audio"): ("audio.tower.model.", "ast", ""),
    ("ast_xlmr", "text"): ("text.tower.model.", "xlmr", ""),
    ("minilm", "text"): ("text.tower.model.", "minilm", ""),
}
"""The pretrained backbones whose saved weights the two steps must move (the CNN starts random)."""
STEP0_CHECKED = {"clap": ("audio", "text"), "ast_xlmr": ("audio", "text"), "minilm": ("text",)}
"""The towers whose step 0 each preset's run checks against the folder's own model."""


@pytest.fixture(scope="module", params=PRESETS)
def preset(request: pytest.FixtureRequest) -> PresetRun:
    return request.getfixturevalue(f"real_{request.param}_run")


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as handle:
        return {key: handle.get_tensor(key) for key in handle.keys()}  # noqa: SIM118


def initial_weights(model: str, folder: Path) -> dict[str, torch.Tensor]:
    """The folder's weights under the module names our towers use (transformers 5 renames some
    modules at load, e.g. AST's ``encoder.layer.N.attention.attention.key`` → ``layers.N.attention.k_proj``)."""
    import transformers

    cls = transformers.ClapModel if model == "clap" else transformers.AutoModel
    return dict(cls.from_pretrained(folder).state_dict())


def test_training_steps_have_finite_losses_and_move_both_towers(preset: PresetRun) -> None:
    rows = [json.loads(line) for line in (preset.run_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    assert losses and all(math.isfinite(v) for v in losses)
    # model.step0_check ran before step 1 (training/bundle/step0.py): every pretrained tower starts as its folder's model
    checks = [row for row in rows if row.get("kind") == "step0_check"]
    assert len(checks) == 1, rows[:3]
    checked = {key for key in checks[0] if key.endswith("_centred_cos")}
    assert checked == {f"{t}_centred_cos" for t in STEP0_CHECKED[preset.name]}, checks[0]
    assert all(checks[0][key] >= checks[0]["threshold"] for key in checked), checks[0]
    checkpoint = preset.checkpoint / "model.safetensors"
    trained = tensors(checkpoint)
    loaded: dict[str, dict[str, torch.Tensor]] = {}  # the clap folder holds both towers: loaded once
    for tower, prefix in TOWER_PREFIXES.items():
        assert any(key.startswith(prefix) for key in trained), f"no {tower} tower in {checkpoint}"
        if (preset.name, tower) not in BACKBONES:
            continue
        ours, model, theirs = BACKBONES[(preset.name, tower)]
        if model not in loaded:
            loaded[model] = initial_weights(model, preset.model_dirs[model])
        initial = loaded[model]
        pairs = [(value, initial.get(theirs + name.removeprefix(ours))) for name, value in trained.items()
                 if name.startswith(ours)]
        found = sum(before is not None for _, before in pairs)
        assert pairs and found >= 0.9 * len(pairs), f"{preset.name}: {ours} keys do not match {model}'s"
        moved = [1 for value, before in pairs if before is not None and not torch.equal(value, before)]
        assert moved, f"{preset.name}: no {tower} backbone weight changed in two steps (no gradient reached it)"


def test_export_passes_parity_and_verifies(preset: PresetRun) -> None:
    manifest = verify_bundle(preset.bundle)
    assert manifest.audio_encoder.parity_min_cosine >= 0.999
    assert manifest.text_encoder.parity_min_cosine >= 0.999


def test_the_service_answers_text_and_audio(preset: PresetRun) -> None:
    import io

    import soundfile as sf

    from index.bundle.format import read_manifest
    from service.app import create_app
    from tests.service.conftest import make_settings, running_client

    # the manifest for its rate and languages only: the full `verify_bundle` (checksums, ONNX
    # sessions, probe, held-out set — ~12 s for ast_xlmr) is test_export_passes_parity_and_verifies',
    # and the service checks every checksum again when it loads the bundle
    manifest = read_manifest(preset.bundle)
    settings = make_settings(bundles_dir=preset.bundle.parent, bundle=preset.bundle.name, gate_metric="t2a_R@10_mean")
    wave = 0.1 * np.sin(np.linspace(0, 2000, manifest.sample_rate * 3)).astype(np.float32)
    upload = io.BytesIO()
    sf.write(upload, wave, manifest.sample_rate, format="WAV")
    with running_client(create_app(settings)) as client:
        r = client.post("/v1/search/text", json={"query": "un chien aboie", "k": 3})
        assert r.status_code == 200, r.text
        assert len(r.json()["hits"]) == 3 and r.json()["bundle_id"] == preset.bundle.name
        r = client.post("/v1/search/audio?k=2", content=upload.getvalue())
        assert r.status_code == 200, r.text
        assert len(r.json()["hits"]) == 2 * len(manifest.languages)  # k caption hits per language
