"""Run-time step-0 check on the full-size random-weight CLAP and AST, on the given device: timings."""
import sys, time, logging, tempfile
from pathlib import Path
import torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
from tests.real_size_models import PRESETS, real_model_dir
from training.config import load_train_config, ConfigError
from training.models.dual_encoder import build_dual_encoder
from training.models.tokenizer import build_tokenizer
from training.step0 import check_step0
device = torch.device(sys.argv[1])
base = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(tempfile.mkdtemp())
t = time.time(); dirs = {n: real_model_dir(n, base) for n in ("clap", "ast")}; print(f"folders {time.time()-t:.1f}s", flush=True)
for preset, over in (("clap.yaml", [f"model.audio.path={dirs['clap']}"]),
                     ("clap.yaml", [f"model.audio.path={dirs['clap']}", "frontend.short_clip_padding=pad"]),
                     ("ast_xlmr.yaml", [f"model.audio.path={dirs['ast']}", "model.text.kind=builtin"]),
                     ("ast_xlmr.yaml", [f"model.audio.path={dirs['ast']}", "model.text.kind=builtin", "frontend.short_clip_padding=pad"])):
    cfg = load_train_config(PRESETS / preset, over)
    tok = build_tokenizer(cfg.model, ["a b c", "d e f"])
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tok.vocab_size).to(device)
    for attempt in range(2):  # the first call on a GPU pays CUDA/cuDNN start-up
        t = time.time()
        try:
            r = check_step0(model, cfg, tok, device)
            print(f"{preset} {over[1:]} try {attempt}: {[(x.tower, round(x.worst, 5)) for x in r]} in {time.time()-t:.2f}s", flush=True)
        except ConfigError as e:
            print(f"{preset} {over[1:]} try {attempt}: STOP in {time.time()-t:.2f}s: {str(e)[:140]}", flush=True)
    del model
