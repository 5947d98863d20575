"""Tower options: activation checkpointing of the built-in towers (the same gradients and BatchNorm
statistics) and optim.compile (the same weights as without)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from tests.conftest import TINY_CONFIG
from training.config import load_train_config
from training.finetune import enable_gradient_checkpointing
from training.loop import train
from training.models.dual_encoder import build_dual_encoder


def _step(checkpointing: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """Gradients and buffers after one backward of both towers (dropout on, BatchNorm in training mode)."""
    overrides = [f"optim.{tower}.gradient_checkpointing={str(checkpointing).lower()}" for tower in ("audio", "text")]
    cfg = load_train_config(TINY_CONFIG, overrides)
    torch.manual_seed(0)
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=64).train()
    enable_gradient_checkpointing(model, cfg)
    blocks = sum(1 for m in model.modules() if getattr(m, "checkpoint_blocks", False))
    generator = torch.Generator().manual_seed(1)
    waveform = 0.1 * torch.randn(4, cfg.frontend.sample_rate, generator=generator)
    ids = torch.randint(1, 64, (4, 7), generator=generator)
    torch.manual_seed(2)  # dropout masks
    loss = model.encode_audio(waveform).sum() + model.encode_text(ids, torch.ones_like(ids)).square().sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return grads, {n: b.clone() for n, b in model.named_buffers()}, blocks


def test_checkpointed_towers_give_the_same_gradients_and_statistics() -> None:
    plain_grads, plain_buffers, none = _step(False)
    grads, buffers, towers = _step(True)
    assert none == 0 and towers == 2  # the audio CNN and the text transformer
    assert grads.keys() == plain_grads.keys() and len(grads) > 10
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)
    running = [n for n in plain_buffers if "running_mean" in n or "num_batches_tracked" in n]
    assert running  # BatchNorm counted the batch once, not again in the recomputation
    for name in running:
        torch.testing.assert_close(buffers[name], plain_buffers[name], msg=name)


def test_compiled_towers_train_like_eager_ones(tiny_corpus: Path, tmp_path: Path) -> None:
    """optim.compile through the real loop (graph capture only: backend eager), with accumulation."""
    small = ["optim.epochs=1", "optim.batch_size=4", "optim.accum_steps=2", "data.max_clips=8", "optim.warmup_steps=1",
             "eval.split=none"]  # no validation: only training is compared
    runs = {}
    for compiled in (False, True):
        out = tmp_path / str(compiled)
        extra = ["optim.compile=true", "optim.compile_backend=eager"] if compiled else []
        train(load_train_config(TINY_CONFIG, [f"data.manifest={tiny_corpus}", f"out_dir={out}", *small, *extra]))
        runs[compiled] = load_file(str(out / "last" / "model.safetensors"))
    assert runs[True].keys() == runs[False].keys()  # compiled in place: checkpoints keep their names
    for name, tensor in runs[False].items():
        torch.testing.assert_close(runs[True][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
