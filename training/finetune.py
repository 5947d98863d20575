"""Fine-tuning controls: per-tower learning rates and weight decay, freezing, gradient checkpointing.

open_clip is the reference: ``lock_text_tower(unlocked_layers, ...)`` /
``lock_image_tower(unlocked_groups, freeze_bn_stats)`` freeze a pretrained tower
except its last layers, and its parameter groups exclude norms, biases and the
temperature from weight decay. Here the settings are ``optim.audio.*`` and
``optim.text.*`` (:class:`training.config.TowerOptimConfig`).

* Parameter groups: each tower's parameters form two AdamW groups (with / without
  weight decay) at ``optim.lr × lr_scale``; the projection heads and the
  objective's parameters (τ, SigLIP's t and b, …) are the ``head`` groups at
  ``optim.lr``. Parameters with fewer than two dimensions — biases, norm
  weights, scalars such as τ — never get weight decay.
* Freezing: a frozen parameter has ``requires_grad = False`` (no gradient, so
  AdamW neither moves nor decays it); a frozen BatchNorm also keeps its running
  statistics (it normalises with them, as in eval mode). Every parameter stays in
  the optimizer, so unfreezing after ``unfreeze_after_epochs`` needs no rebuild.
  The "layers" of a tower are its stack of repeated blocks: the
  ``ModuleList``/``Sequential`` of same-type children holding the most parameters
  (BERT's ``encoder.layer``, the built-in transformer's ``blocks``, the CNN's
  conv ``blocks``); with ``unfrozen_layers = N`` the last N blocks and everything
  registered after the stack (e.g. a final LayerNorm) train.
* Gradient checkpointing: ``gradient_checkpointing_enable`` on every Hugging Face
  model inside the tower.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from training.config import ConfigError, TowerOptimConfig, TrainConfig

TOWERS = ("audio", "text")


def tower(model: nn.Module, name: str) -> nn.Module:
    """The backbone of tower `name` (``model.audio.tower`` / ``model.text.tower``)."""
    return getattr(model, name).tower


def tower_settings(cfg: TrainConfig, name: str) -> TowerOptimConfig:
    settings: TowerOptimConfig = getattr(cfg.optim, name)
    return settings


def decays(parameter: nn.Parameter) -> bool:
    """Weight decay only on matrices and kernels: not on biases, norm weights or scalars (τ)."""
    return parameter.ndim >= 2


def parameter_groups(module: nn.Module, model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
    """AdamW groups of `module` (model + objective): per tower and the heads, each split by weight decay.

    Each group carries ``name`` and ``lr_scale`` (the loop sets ``lr = schedule × lr_scale``).
    """
    owner: dict[int, str] = {}
    for name in TOWERS:
        owner.update({id(p): name for p in tower(model, name).parameters()})
    members: dict[str, list[nn.Parameter]] = {name: [] for name in (*TOWERS, "head")}
    for parameter in module.parameters():
        members[owner.get(id(parameter), "head")].append(parameter)
    groups = []
    for name, parameters in members.items():
        settings = tower_settings(cfg, name) if name in TOWERS else TowerOptimConfig()
        decay = settings.weight_decay if settings.weight_decay is not None else cfg.optim.weight_decay
        for suffix, chosen, weight_decay in (
            ("decay", [p for p in parameters if decays(p)], decay),
            ("no_decay", [p for p in parameters if not decays(p)], 0.0),
        ):
            if chosen:
                groups.append(
                    {
                        "params": chosen,
                        "name": f"{name}.{suffix}",
                        "weight_decay": weight_decay,
                        "lr_scale": settings.lr_scale,
                    }
                )
    return groups


def layer_stack(module: nn.Module) -> nn.Module | None:
    """The module's stack of repeated blocks (see the module docstring), or None."""
    best, best_size = None, 0
    for candidate in module.modules():
        if not isinstance(candidate, nn.ModuleList | nn.Sequential):
            continue
        children = list(candidate.children())
        least = 1 if isinstance(candidate, nn.ModuleList) else 2  # a one-layer list is still the stack
        if len(children) < least or len({type(child) for child in children}) != 1:
            continue
        size = sum(p.numel() for p in candidate.parameters())
        if size > best_size:
            best, best_size = candidate, size
    return best


def unfrozen_parameters(module: nn.Module, layers: int, *, key: str) -> set[int]:
    """Ids of the parameters of the last `layers` blocks of the stack and of what follows it."""
    if layers == 0:
        return set()
    stack = layer_stack(module)
    if stack is None:
        raise ConfigError(f"{key}={layers}: {type(module).__name__} has no stack of layers to unfreeze")
    blocks = list(stack.children())
    if layers > len(blocks):
        raise ConfigError(f"{key}={layers}: {type(module).__name__} has only {len(blocks)} layers")
    stack_ids = {id(p) for p in stack.parameters()}
    ordered = list(module.parameters())
    last_of_stack = max(i for i, p in enumerate(ordered) if id(p) in stack_ids)
    after = {id(p) for p in ordered[last_of_stack + 1 :]}
    return after | {id(p) for block in blocks[-layers:] for p in block.parameters()}


def apply_freezing(model: nn.Module, cfg: TrainConfig, *, epoch: int) -> bool:
    """Set ``requires_grad`` of both towers for 0-based `epoch`; True when anything changed."""
    changed = False
    for name in TOWERS:
        settings, backbone = tower_settings(cfg, name), tower(model, name)
        unfreeze_at = settings.unfreeze_after_epochs
        frozen = settings.freeze and (unfreeze_at is None or epoch < unfreeze_at)
        trainable = (
            unfrozen_parameters(
                backbone, settings.unfrozen_layers, key=f"optim.{name}.unfrozen_layers"
            )
            if frozen
            else {id(p) for p in backbone.parameters()}
        )
        for parameter in backbone.parameters():
            wanted = id(parameter) in trainable
            changed |= parameter.requires_grad != wanted
            parameter.requires_grad_(wanted)
        for norm in backbone.modules():
            if isinstance(norm, nn.modules.batchnorm._BatchNorm) and not hasattr(norm, "_frozen_hook"):
                norm._frozen_hook = norm.register_forward_pre_hook(_frozen_norm_uses_running_stats)
    return changed


def _frozen_norm_uses_running_stats(norm: nn.Module, inputs: Any) -> None:
    """A BatchNorm whose parameters are frozen normalises with, and keeps, its running statistics."""
    parameters = list(norm.parameters(recurse=False))
    if parameters and not any(p.requires_grad for p in parameters):
        norm.training = False


def enable_gradient_checkpointing(model: nn.Module, cfg: TrainConfig) -> None:
    """Activation checkpointing in the towers that ask for it: ``gradient_checkpointing_enable`` on
    Hugging Face models, ``checkpoint_blocks`` on the built-in CNN and transformer
    (training/models/checkpointing.py)."""
    for name in TOWERS:
        if not tower_settings(cfg, name).gradient_checkpointing:
            continue
        hf_models = [
            m
            for m in tower(model, name).modules()
            if getattr(m, "supports_gradient_checkpointing", False)
            and hasattr(m, "gradient_checkpointing_enable")
        ]
        built_in = [m for m in tower(model, name).modules() if hasattr(m, "checkpoint_blocks")]
        if not hf_models and not built_in:
            raise ConfigError(
                f"optim.{name}.gradient_checkpointing: the {name} tower has no checkpointable blocks "
                "(Hugging Face models, the audio CNN and the text transformer have)"
            )
        for module in built_in:
            module.checkpoint_blocks = True
        for hf_model in hf_models:
            if hasattr(hf_model, "activation_checkpointing_enable"):  # transformers >= 5.x
                hf_model.activation_checkpointing_enable({"use_reentrant": False})
            else:
                hf_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def compile_towers(model: nn.Module, cfg: TrainConfig) -> None:
    """``optim.compile``: compile each tower's forward in place (``nn.Module.compile``: parameter
    names, hence checkpoints, unchanged). The first steps pay the compilation; the embedding
    pass of gradient accumulation (no grad) compiles a second graph."""
    if not cfg.optim.compile:
        return
    for name in TOWERS:
        tower(model, name).compile(backend=cfg.optim.compile_backend)


def is_checkpointing(module: nn.Module) -> bool:
    """Whether a Hugging Face model recomputes activations in the backward pass."""
    flag = getattr(module, "is_activation_checkpointing", None)
    return bool(flag if flag is not None else getattr(module, "is_gradient_checkpointing", False))
