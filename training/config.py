"""The one typed configuration tree of `tonearm train` / `evaluate`.

Loaded from YAML, overridden by dotted ``key=value`` pairs from the CLI, validated
once here. Unknown keys are errors everywhere (``extra="forbid"``). Defaults live
only in these classes. The resolved tree is saved beside every checkpoint and in
every bundle manifest.
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from index.errors import TonearmError
from index.languages import DEFAULT_LANGUAGES, validate_language_codes


class ConfigError(TonearmError, ValueError):
    """A configuration file or override that cannot be used, with a readable message."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class FrontendConfig(_Strict):
    """Log-mel frontend (SPEC §2); the same numbers are baked into the ONNX audio encoder."""

    sample_rate: int = 16_000
    n_fft: int = 512
    win_length: int = 400
    hop_length: int = 160
    n_mels: int = 64
    f_min: float = 0.0
    f_max: float = 8_000.0
    short_clip_padding: Literal["auto", "pad", "repeatpad", "repeat", "frames", "reflect"] = "auto"
    """How clips shorter than ``data.clip_seconds`` reach the audio tower, in training, evaluation and
    the exported bundle alike (:mod:`index.audio.frontend`): ``pad`` = zeros after the clip;
    ``repeatpad`` / ``repeat`` = tiled as CLAP's feature extractor does. ``auto`` = the model's own:
    an `hf_clap` tower's extractor setting (``preprocessor_config.json``, else CLAP's default
    ``repeatpad``), ``reflect`` for an `hf_pe_audio` tower (the clip at its own length, reflect-padded to
    the codec's hop by the tower, as ``PeAudioFeatureExtractor``), ``pad`` for every other tower."""


class DataConfig(_Strict):
    manifest: Path | None = None
    """JSONL manifest (SPEC §2). Other formats are converted with `tonearm data convert`."""
    shards: str | None = None
    """Train from `tonearm data shard` output instead of `manifest`: a folder, ``s3://``, ``gs://`` or
    ``https://`` URL read through fsspec (docs/training.md, "Training on a large corpus")."""
    shuffle_buffer: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """With `shards`: training crops each loader worker holds to draw its next one from (more = better
    mixed, more memory: one decoded float32 crop each). ``auto`` = as many as `shuffle_buffer_bytes`
    holds, at most 1000 (docs/training.md, "Training on a large corpus")."""
    shuffle_buffer_bytes: int | None = Field(None, ge=1)
    """Bytes of one loader worker's shuffle buffer for ``shuffle_buffer: auto``; null = 20 % of the
    node's memory (cgroup limit, else physical) shared by every loader worker of the node."""
    languages: list[str] = Field(default_factory=lambda: list(DEFAULT_LANGUAGES))
    drop_other_languages: bool = False
    """Drop captions in languages outside `languages` (counted and reported) instead of
    refusing the manifest; clips left without captions are dropped too."""
    val_fraction: float = Field(0.0, ge=0, lt=1)
    """Carve this fraction of the `train` clips (chosen by `val_seed`) as the validation split
    `eval.split`, for datasets that ship without one; 0 uses the manifest's own split."""
    val_seed: int = 0
    """Seed of the `val_fraction` carve (apart from `seed`, so runs with other seeds share it)."""
    clip_seconds: float = Field(5.0, gt=0)
    eval_crop: Literal["center", "chunk"] = "chunk"
    """Evaluation policy for clips longer than `clip_seconds`: center crop or chunk-and-average."""
    skip_missing_audio: bool = False
    """Missing audio files are an error unless this is set; then they are reported and skipped."""
    num_workers: int | Literal["auto"] = "auto"
    """Loader processes per rank; ``auto`` = the usable cores per rank less one (affinity and
    cgroup quota, at least 1). 0 decodes in the training process (tests, debugging)."""
    prefetch_factor: int = Field(4, ge=1)
    """Batches each loader worker prepares ahead."""
    persistent_workers: bool = True
    """Keep loader workers alive across epochs (no re-fork and re-import every epoch)."""
    max_bad_fraction: float = Field(0.02, ge=0, le=1)
    """Undecodable training clips are replaced, named and counted; the run stops in one line once
    more distinct clips than this fraction of a rank's share have failed."""
    bad_sample_reserve: float = Field(0.004, ge=0, lt=0.5)
    """With `shards`: this fraction of each rank's clips an epoch is the rank's reserve, shared by its
    loader workers, drawn only to fill a batch that lost samples (undecodable, a shard that failed), so
    one rank's bad samples never make the other ranks hold back clips while the rank's losses fit it;
    reserve left undrawn is not served that epoch (docs/training.md, "Training on a large corpus": 0.004
    holds 0 back at 32 ranks with 0.1 % bad samples spread or 5 % of one shard bad). 0 = no reserve
    (every rank trains the smallest batch)."""
    max_clips: int | None = Field(None, ge=1)
    """Use only the first N clips of each split (quick experiments)."""
    read_retries: int = Field(4, ge=0)
    """With `shards`: retries of a shard read that fails (a dropped connection, an object store's
    5xx), each resuming at the byte offset of the first sample not yet read; only a sample still
    unreadable after them counts against `max_bad_fraction`."""
    read_backoff_seconds: float = Field(0.5, ge=0)
    """Wait before the first retry of a shard read; it doubles with each retry (0.5, 1, 2, 4 s)."""

    @model_validator(mode="after")
    def _check_languages(self) -> DataConfig:
        validate_language_codes(self.languages)
        return self


class AudioTowerConfig(_Strict):
    kind: Literal["cnn", "hf_ast", "hf_clap", "hf_pe_audio", "hf_auto"] = "cnn"
    path: str | None = None
    """Local directory or hub id for the `hf_*` kinds (from_pretrained)."""
    channels: list[int] = Field(default_factory=lambda: [32, 64, 128, 192])
    dropout: float = Field(0.1, ge=0, lt=1)


class TextTowerConfig(_Strict):
    kind: Literal["builtin", "hf_auto", "hf_clap", "hf_pe_audio"] = "builtin"
    path: str | None = None
    pooling: Literal["mean", "cls"] = "mean"
    vocab_size: int = Field(4000, ge=260)
    max_length: int = Field(48, ge=4)
    width: int = Field(192, ge=16)
    layers: int = Field(3, ge=1)
    heads: int = Field(4, ge=1)
    dropout: float = Field(0.1, ge=0, lt=1)


class ModelConfig(_Strict):
    embed_dim: int = Field(256, ge=8)
    init_checkpoint: Path | None = None
    """Start from this checkpoint's weights (e.g. the distillation student, SPEC §4.4)."""
    step0_check: bool = True
    """Before step 1 of a run that loads a pretrained folder (``hf_clap`` / ``hf_ast`` audio, ``hf_clap`` /
    ``hf_auto`` text; not on resume or ``init_checkpoint``), embed four synthetic clips and four captions
    through the training model and through the folder's own transformers model, extractor and
    tokenizer, and stop with one line when their centred cosine falls below 0.99
    (training/bundle/step0.py; docs/training.md, "Fine-tune a pretrained CLAP or AST")."""
    audio: AudioTowerConfig = Field(default_factory=AudioTowerConfig)
    text: TextTowerConfig = Field(default_factory=TextTowerConfig)


class TowerOptimConfig(_Strict):
    """Fine-tuning controls of one tower (open_clip's lock/unlock and per-group learning rates).

    The tower is the backbone (CNN, transformer, Hugging Face model); its projection
    head and the objective's parameters always train at `optim.lr`.
    """

    lr_scale: float = Field(1.0, gt=0)
    """The tower's learning rate is `optim.lr × lr_scale` (e.g. 0.1 for a pretrained tower)."""
    weight_decay: float | None = Field(None, ge=0)
    """The tower's weight decay (null: `optim.weight_decay`); never on norms, biases, scalars."""
    freeze: bool = False
    """Freeze the tower's weights (BatchNorm statistics included), except `unfrozen_layers`."""
    unfrozen_layers: int = Field(0, ge=0)
    """With `freeze`: the last N layers of the tower's layer stack (and what follows it,
    e.g. a final norm) still train."""
    unfreeze_after_epochs: int | None = Field(None, ge=1)
    """With `freeze`: the whole tower trains from epoch E + 1 on."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass (every tower: Hugging Face models, the audio CNN's
    and the text transformer's blocks): less memory, ~30 % more time."""

    @model_validator(mode="after")
    def _check_freeze(self) -> TowerOptimConfig:
        if not self.freeze and (self.unfrozen_layers or self.unfreeze_after_epochs is not None):
            raise ValueError("unfrozen_layers / unfreeze_after_epochs need freeze: true")
        return self


class OptimConfig(_Strict):
    epochs: int = Field(20, ge=1)
    max_steps: int | None = Field(None, ge=1)
    """Stop after this many optimizer steps (smoke tests, quick runs)."""
    batch_size: int = Field(64, ge=2)
    """Rows one optimizer step sees on each rank (the global batch is batch_size × ranks)."""
    accum_steps: int = Field(1, ge=1)
    """Compute each step's batch in this many micro-batches of batch_size / accum_steps:
    less activation memory, the same step — the objective still sees the whole batch
    (GradCache-style, training/accumulate.py; docs/training.md, "Training on many GPUs")."""
    compile: bool = False
    """``torch.compile`` the audio and text towers (in place: checkpoints keep their keys)."""
    compile_backend: str = "inductor"
    """torch.compile backend (``inductor`` generates kernels; ``eager`` only captures graphs)."""
    lr: float = Field(5e-4, gt=0)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[float, float] = (0.9, 0.98)
    warmup_steps: int = Field(100, ge=0)
    schedule: Literal["cosine", "step", "constant"] = "cosine"
    step_size_epochs: int = Field(10, ge=1)
    step_gamma: float = Field(0.1, gt=0, le=1)
    grad_clip: float | None = Field(1.0, gt=0)
    amp: bool = True
    """Mixed precision; only takes effect on CUDA."""
    amp_dtype: Literal["auto", "bf16", "fp16"] = "auto"
    """``auto`` = bf16 where the GPU supports it, else fp16 (fp16 always runs with a grad scaler)."""
    audio: TowerOptimConfig = Field(default_factory=TowerOptimConfig)
    text: TowerOptimConfig = Field(default_factory=TowerOptimConfig)

    @model_validator(mode="after")
    def _check_accumulation(self) -> OptimConfig:
        if self.batch_size % self.accum_steps:
            raise ValueError(
                f"optim.accum_steps={self.accum_steps} must divide optim.batch_size={self.batch_size} "
                "(micro-batches of batch_size / accum_steps rows)"
            )
        return self


class ObjectiveConfig(_Strict):
    """Base loss + multilingual strategy + regularizers + distillation + knowledge (SPEC §4).

    Each entry is ``{"name": registry key, **params}``; the registry validates the
    params against the objective's own config class.
    """

    base: dict[str, Any] = Field(default_factory=lambda: {"name": "infonce"})
    strategy: dict[str, Any] = Field(default_factory=lambda: {"name": "random"})
    regularizers: list[dict[str, Any]] = Field(default_factory=list)
    distill: dict[str, Any] | None = None
    knowledge: dict[str, Any] | None = None


class EvalConfig(_Strict):
    every_epochs: int = Field(1, ge=1)
    split: str = "val"
    batch_size: int = Field(64, ge=1)
    select_metric: str = "t2a_R@10_mean"
    """Metric (key of the evaluation report) that decides the `best` checkpoint."""


class DistributedConfig(_Strict):
    """Multi-process training under torchrun (docs/training.md, "Distributed")."""

    loss: Literal["global", "local"] = "global"
    """``global``: every rank scores the whole gathered batch (all objectives);
    ``local``: each rank scores its own rows against it (InfoNCE/SigLIP bases only)."""
    timeout_s: float = Field(600.0, gt=0)
    """Rendezvous, collective and barrier timeout (NCCL's watchdog too): a stale rendezvous or a
    hung rank fails after this long. A rank that *raises* ends the job at once, without waiting
    for it (docs/training.md, "Training on a large corpus"); keep it above the longest wait
    between ranks (validation, knowledge-base refreshes at an epoch's end)."""
    force_process_group: bool = False
    """Create the process group (NCCL on a GPU) even at world size 1 — a plain process or a
    one-process torchrun — so that DDP and every collective of the loop run as on many GPUs:
    one GPU then measures what they cost and checks that every tensor they send lives there."""
    find_unused_parameters: bool = False
    """Let DDP search every step for parameters without a gradient (slower); only for a
    model or objective that leaves some trainable parameters out of the loss."""


class LogConfig(_Strict):
    """What training logs beside ``metrics.jsonl`` (training/observe.py, docs/training.md)."""

    tensorboard: bool = True
    """TensorBoard event files in `out_dir` (rank 0): ``tensorboard --logdir OUT_DIR``."""
    wandb: str | None = None
    """W&B project to log to (or env WANDB_PROJECT); needs the `wandb` package."""
    data_wait_warn: float = Field(0.2, ge=0, le=1)
    """Warn when the fraction of step time spent waiting for data exceeds this ..."""
    data_wait_windows: int = Field(2, ge=1)
    """... in this many consecutive logging windows (the start-up window does not count)."""


class TrainConfig(_Strict):
    seed: int = 0
    out_dir: Path = Path("runs/default")
    device: Literal["auto", "cpu", "cuda"] = "auto"
    threads: int | None = Field(None, ge=1)
    resume: bool = False
    """Continue from `out_dir/last` when it exists."""
    overwrite: bool = False
    """Start afresh in an `out_dir` that holds a previous run's checkpoints (deleting them);
    without it (or `resume`) such a run is refused."""
    save_every_steps: int | None = Field(None, ge=1)
    """Also save `last/` (weights, optimizer, RNG and the epoch's sample position) every this
    many optimizer steps, mid-epoch; `resume: true` continues from there on any world size.
    ``None``: only at each epoch's end (and when interrupted)."""
    frontend: FrontendConfig = Field(default_factory=FrontendConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    objective: ObjectiveConfig = Field(default_factory=ObjectiveConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    log: LogConfig = Field(default_factory=LogConfig)

    @model_validator(mode="after")
    def _check_run_choice(self) -> TrainConfig:
        if self.resume and self.overwrite:
            raise ValueError("resume and overwrite exclude each other: continue the run or replace it")
        return self

    @model_validator(mode="after")
    def _resolve_short_clip_padding(self) -> TrainConfig:
        """``frontend.short_clip_padding: auto`` → the audio tower's own policy, once, so every data path
        (training crops, evaluation windows, knowledge-base passes) and the export read one value."""
        if self.frontend.short_clip_padding == "auto":
            self.frontend.short_clip_padding = model_short_clip_padding(self.model.audio)
        return self


def model_short_clip_padding(audio: AudioTowerConfig) -> Literal["pad", "repeatpad", "repeat", "frames", "reflect"]:
    """The padding a tower's own feature extractor applies to short clips (see ``short_clip_padding``):
    AST's extractor pads fbank frames (``frames``, :mod:`index.audio.frontend`), CLAP's reads its
    ``padding``; every other tower zero-pads the waveform."""
    if audio.kind == "hf_ast":
        return "frames"
    if audio.kind == "hf_pe_audio":
        return "reflect"
    if audio.kind != "hf_clap":
        return "pad"
    settings = Path(audio.path) / "preprocessor_config.json" if audio.path else None
    if settings is not None and settings.is_file():
        padding = json.loads(settings.read_text(encoding="utf-8")).get("padding", "repeatpad")
        if padding in ("pad", "repeatpad", "repeat"):
            return padding  # type: ignore[no-any-return]
        raise ConfigError(f"{settings}: padding {padding!r} is not one of pad, repeatpad, repeat")
    return "repeatpad"  # ClapFeatureExtractor's default (laion/clap-htsat-unfused)


def short_clip_padding(frontend: FrontendConfig) -> Literal["pad", "repeatpad", "repeat", "frames", "reflect"]:
    """The resolved padding of a front end (``auto`` outside a TrainConfig = ``pad``)."""
    value = frontend.short_clip_padding
    return "pad" if value == "auto" else value


def _parse_scalar(text: str) -> Any:
    """Parse an override value with YAML rules (``3`` → int, ``[a, b]`` → list, ``null``)."""
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(tree: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``a.b.c=value`` overrides to a nested dict (returns the same dict)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key.path=value")
        dotted, raw = item.split("=", 1)
        keys = dotted.strip().split(".")
        node = tree
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {dotted!r}: {key!r} is not a section")
            node = child
        node[keys[-1]] = _parse_scalar(raw)
    return tree


def config_keys(model: type[BaseModel] = TrainConfig, prefix: str = "") -> list[str]:
    """Every dotted key of the config tree (sections and leaves), e.g. ``optim.lr``."""
    keys = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys += config_keys(field.annotation, f"{dotted}.")
    return keys


def closest_key(dotted: str) -> str:
    """`` (did you mean optim.lr?)`` for the known key closest to `dotted`, or ``""``."""
    keys = config_keys()
    section, _, leaf = dotted.rpartition(".")
    initials = "".join(word[0] for word in leaf.split("_") if word)
    if f"{section}.{initials}".lstrip(".") in keys and "_" in leaf:  # learning_rate → lr
        return f" (did you mean {section + '.' if section else ''}{initials}?)"
    matches = difflib.get_close_matches(dotted, keys, n=1, cutoff=0.6)
    if not matches:  # a typo in the last part only: compare leaf names
        leaves = {key.rsplit(".", 1)[-1]: key for key in keys}
        matches = [leaves[m] for m in difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)]
    return f" (did you mean {matches[0]}?)" if matches else ""


def check_override_keys(overrides: list[str]) -> None:
    """Every override names a key of the tree; else a one-line error naming it, with a suggestion.

    Keys inside free-form sections (``objective.base.tau``) are checked by the objective.
    """
    for item in overrides:
        dotted = item.split("=", 1)[0].strip()
        model: type[BaseModel] = TrainConfig
        for part in dotted.split("."):
            field = model.model_fields.get(part)
            if field is None:
                raise ConfigError(f"override {item!r}: unknown key {dotted!r}{closest_key(dotted)}")
            if not (isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)):
                break  # a leaf or a free-form mapping
            model = field.annotation


def _format_validation_error(err: ValidationError, source: str, overrides: list[str]) -> str:
    from_override = {item.split("=", 1)[0].strip(): item for item in overrides}
    lines = [f"invalid configuration ({source}):"]
    for problem in err.errors():
        where = ".".join(str(p) for p in problem["loc"]) or "<root>"
        origin = f" (override {from_override[where]!r})" if where in from_override else ""
        if problem["type"] == "extra_forbidden":
            lines.append(f"  - unknown key '{where}'{closest_key(where)}{origin}")
        else:
            lines.append(f"  - {where}: {problem['msg']}{origin}")
    return "\n".join(lines)


EXTENDS_KEY = "extends"
"""A preset may start from another file: ``extends: ../default.yaml`` (relative to the preset)."""
REPLACED_WHOLE = frozenset({"objective"})
"""Sections a preset replaces instead of merging: an objective is one composition, and a
SigLIP base must not inherit InfoNCE's ``tau``."""


def _merge(parent: dict[str, Any], child: dict[str, Any], *, top: bool) -> dict[str, Any]:
    merged = dict(parent)
    for key, value in child.items():
        inherited = merged.get(key)
        if isinstance(value, dict) and isinstance(inherited, dict) and not (top and key in REPLACED_WHOLE):
            merged[key] = _merge(inherited, value, top=False)
        else:
            merged[key] = value
    return merged


def read_config_tree(path: Path, *, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """The YAML mapping of a preset with its ``extends`` chain resolved (child wins)."""
    path = path.resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"config files extend each other in a cycle: {chain}")
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML: {err}") from None
    if loaded is not None and not isinstance(loaded, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(loaded).__name__}")
    tree = dict(loaded or {})
    parent_name = tree.pop(EXTENDS_KEY, None)
    if parent_name is None:
        return tree
    parent = read_config_tree(path.parent / str(parent_name), _seen=(*_seen, path))
    return _merge(parent, tree, top=True)


def load_train_config(path: Path | str | None, overrides: list[str] | None = None) -> TrainConfig:
    """Read a YAML preset (or start from defaults when `path` is None) and apply overrides."""
    tree: dict[str, Any] = {}
    source = "defaults"
    if path is not None:
        tree = read_config_tree(Path(path))
        source = str(path)
    overrides = list(overrides or [])
    apply_overrides(tree, overrides)
    check_override_keys(overrides)
    try:
        return TrainConfig.model_validate(tree)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, source, overrides)) from None
