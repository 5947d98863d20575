"""TONEARM_ONNX_PROVIDERS: the service's bundles open with the configured onnxruntime providers."""

from __future__ import annotations

from pathlib import Path

import onnxruntime as ort
import pytest

from service.bundles import default_opener
from service.settings import Settings
from tonearm.errors import TonearmError


def test_the_configured_providers_run_the_encoders(tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TONEARM_ONNX_PROVIDERS", "CPUExecutionProvider")
    bundle = default_opener(Settings())(tiny_bundle)
    assert bundle.onnx_providers == ["CPUExecutionProvider"]
    assert bundle.encode_text(["rain on a tin roof"]).shape == (1, bundle.embed_dim)


def test_a_provider_this_onnxruntime_lacks_is_refused_by_name(
    tiny_bundle: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    missing = next(
        name
        for name in ("CUDAExecutionProvider", "TensorrtExecutionProvider", "ROCMExecutionProvider")
        if name not in ort.get_available_providers()
    )
    monkeypatch.setenv("TONEARM_ONNX_PROVIDERS", f"{missing},CPUExecutionProvider")
    with pytest.raises(TonearmError, match=f"providers \\['{missing}'\\] are not available"):
        default_opener(Settings())(tiny_bundle)
