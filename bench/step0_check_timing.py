"""Time the run-time step-0 check (training/bundle/step0.py) on the full-size random-weight CLAP and AST.

    PYTHONPATH=. python bench/step0_check_timing.py cpu|cuda [FOLDER_FOR_THE_MODELS]

Builds the two model folders as the tests do (tests/real_size_models.py; reused when FOLDER holds
them), then runs ``check_step0`` twice per case (the first call on a GPU pays its start-up): the CLAP
pair and AST-base with their own padding (must pass) and with a waveform zero-pad (must stop).
"""

from __future__ import annotations

import logging
import sys
import tempfile
import time
from pathlib import Path

import torch

from tests.real_size_models import PRESETS, real_model_dir
from training.bundle.step0 import check_step0
from training.config import ConfigError, load_train_config
from training.models.dual_encoder import build_dual_encoder
from training.models.tokenizer import build_tokenizer

log = logging.getLogger("step0_check_timing")


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    device = torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu")
    base = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp())
    start = time.time()
    dirs = {name: real_model_dir(name, base) for name in ("clap", "ast")}
    log.info("model folders: %.1f s", time.time() - start)
    cases = [
        ("clap.yaml", [f"model.audio.path={dirs['clap']}"]),
        ("clap.yaml", [f"model.audio.path={dirs['clap']}", "frontend.short_clip_padding=pad"]),
        ("ast_xlmr.yaml", [f"model.audio.path={dirs['ast']}", "model.text.kind=builtin"]),
        ("ast_xlmr.yaml", [f"model.audio.path={dirs['ast']}", "model.text.kind=builtin",
                           "frontend.short_clip_padding=pad"]),
    ]
    for preset, overrides in cases:
        cfg = load_train_config(PRESETS / preset, overrides)
        tokenizer = build_tokenizer(cfg.model, ["a b c", "d e f"])
        model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size).to(device)
        for attempt in range(2):
            start = time.time()
            try:
                results = check_step0(model, cfg, tokenizer, device)
                outcome = str([(r.tower, round(r.worst, 5)) for r in results])
            except ConfigError as err:
                outcome = f"STOP: {str(err)[:120]}"
            log.info("%s %s try %d: %.2f s %s", preset, overrides[1:], attempt, time.time() - start, outcome)
        del model


if __name__ == "__main__":
    main()
