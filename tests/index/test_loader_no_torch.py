"""`index.runtime.loader` serves a bundle with neither torch nor training importable (SPEC §1)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from index.runtime.loader import LoadedBundle

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r"""
import importlib.abc, json, sys

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "training", "torchaudio", "transformers"}:
            raise ImportError(f"{name} is blocked in this test")
        return None

sys.meta_path.insert(0, Block())
import numpy as np
from index.runtime.verify import verify_bundle
from index.runtime.evaluate import evaluate_bundle
from index.runtime.loader import LoadedBundle

verify_bundle(sys.argv[1])
bundle = LoadedBundle.open(sys.argv[1], intra_op_threads=1)
bundle.warmup()
text = bundle.encode_text(["a dog barks", "un chien aboie"])
held_out = bundle.eval_set()
audio = bundle.encode_audio(held_out.waveforms[:2])
t_scores, t_rows = bundle.search_audio(text, 3)
a_scores, a_rows = bundle.search_text(audio, 3, languages=["fra"])
report = evaluate_bundle(bundle)
blocked = [m for m in sys.modules if m.split(".")[0] in {"torch", "training"}]
print(json.dumps({"t_rows": t_rows.tolist(), "a_rows": a_rows.tolist(), "text": text.tolist(),
                  "r10": report["t2a_R@10_mean"], "blocked": blocked}))
"""


def test_bundle_opens_encodes_and_searches_without_torch(tiny_bundle):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tiny_bundle)],
        capture_output=True, text=True, cwd=ROOT, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = json.loads(result.stdout.strip().splitlines()[-1])
    assert out["blocked"] == []
    # Same numbers as in this (torch-importing) process.
    bundle = LoadedBundle.open(tiny_bundle)
    text = bundle.encode_text(["a dog barks", "un chien aboie"])
    np.testing.assert_allclose(np.array(out["text"]), text, atol=1e-5)
    assert out["t_rows"] == bundle.search_audio(text, 3)[1].tolist()
    audio = bundle.encode_audio(bundle.eval_set().waveforms[:2])
    rows = bundle.search_text(audio, 3, languages=["fra"])[1]
    assert out["a_rows"] == rows.tolist()
    assert all(bundle.text_items[r]["lang"] == "fra" for r in rows.ravel())
    assert out["r10"] == bundle.manifest.evaluation.report["t2a_R@10_mean"]


def test_blocking_really_blocks_torch():
    """The guard itself works: importing torch under it fails."""
    script = SCRIPT.split("import numpy as np")[0] + "import torch\n"
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode != 0 and "blocked" in result.stderr
