"""Gradient accumulation that keeps a contrastive objective exact (``optim.accum_steps``).

Summing the gradients of N micro-batch *losses* changes a contrastive objective: each
micro-batch would only see its own negatives (a batch of 64, not 256). Instead, as
GradCache (Gao et al. 2021) and open_clip's ``--accum-freq`` do, one optimizer step on a
batch of B rows in N micro-batches of B / N runs three passes:

1. **embed** every micro-batch without gradient (activations freed at once), keeping
   only the (B, d) audio and (V, B, d) text embeddings — the RNG state before each
   micro-batch is remembered, and BatchNorm running statistics are put back afterwards;
2. **score** the objective once on the whole batch of cached embeddings (gathered over
   ranks as usual, so every term — InfoNCE, SigLIP, SVR, KCL/CACL, OT, ASK,
   distillation — sees the full batch) and backpropagate to the embeddings and to the
   objective's own parameters;
3. **re-embed** each micro-batch with gradient, replaying its RNG state (dropout and any
   in-model augmentation draw the same values as in pass 1), and backpropagate the
   cached embedding gradients through it (the surrogate ⟨e, ∂L/∂e⟩). Under DDP the first
   N − 1 run under ``no_sync``; the last also carries the objective's parameter
   gradients (⟨p, ∂L/∂p⟩), so one all-reduce synchronises everything.

The loss and every gradient equal those of the whole batch in one pass up to the order of
float sums (tests/training/test_accumulation.py), except with BatchNorm in training mode,
whose batch statistics are those of a micro-batch. The price: every micro-batch's tower
forward runs twice (≈ +33 % compute for a forward ≈ ½ backward); the memory of
activations is that of one micro-batch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from training.objectives import total_loss

BATCH_DIMS = {"waveform": 0, "input_ids": 1, "attention_mask": 1, "text_mask": 1}
"""Batch dimension of each tower input split into micro-batches."""


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (the module itself otherwise)."""
    return module.module if isinstance(module, nn.parallel.DistributedDataParallel) else module


def micro_batches(inputs: dict[str, Tensor | None], steps: int) -> list[dict[str, Tensor]]:
    """The tower inputs cut into `steps` micro-batches along each input's batch dimension
    (a short last batch of an epoch gives smaller or fewer micro-batches)."""
    waveform = inputs["waveform"]
    assert waveform is not None
    rows = int(waveform.shape[0])
    bounds = torch.linspace(0, rows, min(steps, rows) + 1).round().long().tolist()
    out = []
    for start, stop in zip(bounds[:-1], bounds[1:], strict=True):
        micro = {}
        for name, dim in BATCH_DIMS.items():
            tensor = inputs[name]
            assert tensor is not None
            micro[name] = tensor.narrow(dim, start, stop - start)
        out.append(micro)
    return out


def _rng_state(device: torch.device) -> tuple[Tensor, Tensor | None]:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.get_rng_state(), cuda


def _set_rng_state(state: tuple[Tensor, Tensor | None], device: torch.device) -> None:
    torch.set_rng_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


@contextlib.contextmanager
def _batchnorm_statistics_kept(module: nn.Module) -> Any:
    """Put BatchNorm running statistics back after pass 1 (pass 3 updates them once)."""
    saved = [
        (buffer, buffer.detach().clone())
        for layer in module.modules()
        if isinstance(layer, nn.modules.batchnorm._BatchNorm)
        for buffer in layer.buffers()
    ]
    try:
        yield
    finally:
        with torch.no_grad():
            for buffer, value in saved:
                buffer.copy_(value)


def accumulated_backward(
    step_module: nn.Module,
    inputs: dict[str, Tensor | None],
    steps: int,
    *,
    autocast: Callable[[], contextlib.AbstractContextManager[Any]],
    scale: Callable[[Tensor], Tensor] = lambda loss: loss,
    device: torch.device | None = None,
) -> tuple[dict[str, Tensor], Tensor]:
    """(terms, loss) of the whole batch; the parameters' ``.grad`` receive its gradient (module doc).

    `step_module` is a :class:`training.loop.TrainStep`, possibly inside DDP; `scale` is the
    grad scaler's ``scale`` (fp16); `device` is where the RNG states to replay live.
    """
    inner: Any = unwrap(step_module)  # a TrainStep (training/loop.py imports this module)
    device = device or inputs["waveform"].device  # type: ignore[union-attr]
    micros = micro_batches(inputs, steps)

    # 1. Embeddings of every micro-batch, no graph kept.
    states, audio_parts, text_parts = [], [], []
    with torch.no_grad(), _batchnorm_statistics_kept(inner.model):
        for micro in micros:
            states.append(_rng_state(device))
            with autocast():
                audio, text = inner.embed(**micro)
            audio_parts.append(audio)
            text_parts.append(text)
    after = _rng_state(device)

    # 2. The objective once, on the whole batch.
    audio = torch.cat(audio_parts, 0).requires_grad_()
    text = torch.cat(text_parts, 1).requires_grad_()
    with autocast():
        terms = inner.score(
            audio, text, inputs["text_mask"], inputs["clip_index"], inputs.get("teacher_audio"),
            inputs.get("teacher_text"),
        )
        loss = total_loss(terms)
    scale(loss).backward()
    assert audio.grad is not None and text.grad is not None
    objective_grads = {}
    for name, parameter in inner.objective.named_parameters():
        if parameter.grad is not None:
            objective_grads[name] = parameter.grad
            parameter.grad = None

    # 3. Each micro-batch again, with gradient, its embedding gradient backpropagated.
    sync_later = getattr(step_module, "no_sync", None)
    start = 0
    for index, (micro, state) in enumerate(zip(micros, states, strict=True)):
        rows = int(micro["waveform"].shape[0])
        last = index == len(micros) - 1
        _set_rng_state(state, device)
        context = sync_later() if sync_later is not None and not last else contextlib.nullcontext()
        with context:
            with autocast():
                out = step_module(
                    **micro,
                    audio_grad=audio.grad[start : start + rows],
                    text_grad=text.grad[:, start : start + rows],
                    objective_grads=objective_grads if last else None,
                )
            out["surrogate"].backward()
        start += rows
    _set_rng_state(after, device)
    return terms, loss.detach()


def surrogate(
    audio: Tensor,
    text: Tensor,
    audio_grad: Tensor,
    text_grad: Tensor,
    objective: nn.Module,
    objective_grads: dict[str, Tensor] | None,
) -> Tensor:
    """⟨e, ∂L/∂e⟩ over the micro-batch's embeddings (+ ⟨p, ∂L/∂p⟩ for the objective's parameters):
    its gradient with respect to every parameter is the cached one."""
    dtype = torch.promote_types(audio.dtype, torch.float32)  # at least float32 under autocast
    value = (audio.to(dtype) * audio_grad.to(dtype)).sum() + (text.to(dtype) * text_grad.to(dtype)).sum()
    if objective_grads:
        for name, parameter in objective.named_parameters():
            if name in objective_grads:
                value = value + (parameter * objective_grads[name].to(parameter.dtype)).sum()
    return value
