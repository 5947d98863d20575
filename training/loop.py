"""`tonearm train CONFIG [key=value ...]`: the training loop.

Reads top to bottom as setup → build → loop → teardown (nanoGPT style, no
callbacks): :func:`train` sets up the process, :func:`build_run` builds data,
tokenizer, model, objective and optimizer, :func:`run_epochs` is the loop, and the
helpers below it each do one thing (a step, an epoch's end, validation, saving).

Outputs in ``out_dir``: ``best/`` and ``last/`` checkpoints (``last`` also holds the
optimizer, scaler, objective, RNG and loop state for ``resume: true``),
``metrics.jsonl`` (step / epoch / eval records) and ``curves.png``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, DistributedSampler

from index.errors import DataError
from training import distributed
from training.accumulate import accumulated_backward, surrogate
from training.bundle import step0
from training.config import ConfigError, TrainConfig, load_train_config, short_clip_padding
from training.context import LoopContext
from training.data.loader import BadSampleBudget, loader_options, loader_workers
from training.data.shard_records import caption_texts
from training.data.splits import TRAIN_SPLIT
from training.data.stream import StreamBatches, build_stream_loader, cached_corpus, load_shard_data
from training.elastic import EpochBatches, rederived_seed, resumed_rng_state
from training.evaluate import EvalSet, clip_samples, prepare_eval_set, report_keys
from training.finetune import (
    apply_freezing,
    compile_towers,
    enable_gradient_checkpointing,
    parameter_groups,
)
from training.interrupt import StopRequest, TrainingInterrupted, ignore_ctrl_c
from training.models.dual_encoder import DualEncoder
from training.objectives import EmbeddingBatch, Objective, build_objective, total_loss
from training.objectives.base import BuildEnv
from training.observe import Observer
from training.rundir import (
    delete_previous_run,
    refuse_unless_chosen,
    train_command,
    train_overrides,
)
from training.runtime import (
    Runtime,
    autocast,
    barrier,
    capture_rng_state,
    flatten_optimizer_state,
    load_trainer_state,
    make_grad_scaler,
    restore_rng_state,
    save_trainer_state,
    seed_everything,
    setup_runtime,
    teardown_runtime,
    unflatten_optimizer_state,
)
from training.schedule import Schedule
from training.validation import evaluate_shared

log = logging.getLogger(__name__)

LOG_EVERY_STEPS = 10
"""Per-step loss terms go to metrics.jsonl every this many steps (and at step 1)."""
LOWER_IS_BETTER = ("mrv_", "mean_rank_std_", "gap_", "dis_")


@dataclass
class LoopState:
    """Where the loop is; saved in ``last/trainer_state.json`` for an exact resume."""

    epoch: int = 0
    """Epochs completed."""
    step: int = 0
    """Optimizer steps completed."""
    batch_in_epoch: int = 0
    best_value: float | None = None
    best_step: int | None = None
    epoch_loss_sum: float = 0.0
    epoch_loss_count: int = 0
    samples_in_epoch: int | None = None
    """Clips of the epoch's global order consumed (training/elastic.py), set when `last/` is
    saved; what a resume on another world size continues from."""


@dataclass
class Run:
    """Everything :func:`build_run` builds; the loop only reads these (and updates `state`)."""

    cfg: TrainConfig
    runtime: Runtime
    model: DualEncoder
    objective: Objective
    step_module: nn.Module
    tokenizer: Any
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    schedule: Schedule
    loader: Iterable[Any]
    batches: EpochBatches | StreamBatches
    context: LoopContext
    val_set: EvalSet | None
    teachers: Any | None
    metrics: MetricsLog
    steps_per_epoch: int
    total_steps: int
    has_validation: bool
    bad_samples: BadSampleBudget
    observer: Observer
    state: LoopState = field(default_factory=LoopState)


# --- setup / teardown ------------------------------------------------------------------------


def cli_train(args: argparse.Namespace) -> int:
    """Entry point of `tonearm train`."""
    command = train_command(args)
    cfg = load_train_config(args.config, train_overrides(args))
    try:
        train(cfg, command=command)
    except TrainingInterrupted as stop:
        log.warning(
            "interrupted at step %d (epoch %d, batch %d); %s saved. Resume with: %s resume=true",
            stop.step, stop.epoch + 1, stop.batch_in_epoch, cfg.out_dir / "last", command,
        )
        return 130
    return 0


def train(
    cfg: TrainConfig,
    *,
    interrupt_after_steps: int | None = None,
    command: str = "tonearm train CONFIG [overrides]",
) -> Path:
    """Train per `cfg`; returns `cfg.out_dir`.

    `interrupt_after_steps` stops after that many optimizer steps (counted from the
    start of the run, not of this process) and saves `last/` as an interruption
    would — for time-boxed jobs and the resume test. Ctrl-C (SIGINT) or SIGTERM
    stops at the next step boundary, saves `last/` and raises
    :class:`TrainingInterrupted`. `command` is the command line quoted in the
    messages that say how to resume or start afresh.
    """
    runtime = setup_runtime(
        device=cfg.device,
        amp=cfg.optim.amp,
        amp_dtype=cfg.optim.amp_dtype,
        threads=cfg.threads,
        timeout_s=cfg.distributed.timeout_s,
        force_group=cfg.distributed.force_process_group,
    )
    # The run (DDP's Reducer holds the process group; loaders hold persistent workers) lives only in
    # `owned`, so that teardown_runtime frees it *before* the group is destroyed, on every path
    # (training/distributed.py, "the order of the end": else a rank can deadlock at its very end).
    owned: list[Run] = []
    try:
        prepare_out_dir(cfg, runtime, command=command)
        seed_everything(cfg.seed + runtime.rank)
        owned.append(build_run(cfg, runtime))
        with StopRequest() as stop:
            run_epochs(owned[0], interrupt_after_steps=interrupt_after_steps, stop=stop)
    except TrainingInterrupted as interrupted:  # every rank stopped at the same step boundary (stop_requested)
        teardown_runtime(runtime, owners=owned, error=interrupted, together=True)
        raise
    except BaseException as err:  # this rank alone may have failed: no barrier, the job ends now
        teardown_runtime(runtime, owners=owned, error=err)
        raise
    teardown_runtime(runtime, owners=owned)
    return cfg.out_dir


def prepare_out_dir(cfg: TrainConfig, runtime: Runtime, *, command: str) -> None:
    """Never replace a previous run silently (training/rundir.py): resume, overwrite, or refuse."""
    refuse_unless_chosen(cfg, command=command)
    barrier(runtime)  # every rank has looked before rank 0 deletes
    if runtime.is_main:
        delete_previous_run(cfg)
    barrier(runtime)


# --- build ------------------------------------------------------------------------------------


def build_run(cfg: TrainConfig, runtime: Runtime) -> Run:
    """Data, tokenizer, model, objective, optimizer, loader; restores `last/` when resuming."""
    train_records, val_records = load_training_data(cfg)
    resume_dir = cfg.out_dir / "last" if cfg.resume and (cfg.out_dir / "last").is_dir() else None
    cfg, model, tokenizer = build_model(cfg, train_records, runtime, resume_dir=resume_dir)
    model.to(runtime.device).train()  # checkpoints load in eval mode
    step0_checked = check_pretrained_start(cfg, model, tokenizer, runtime, resuming=resume_dir is not None)
    env = BuildEnv(languages=tuple(cfg.data.languages), embed_dim=model.embed_dim)
    objective = build_objective(cfg.objective, env).to(runtime.device)
    loss_mode = distributed.loss_mode_for(cfg.distributed.loss, objective, runtime.world_size)
    apply_freezing(model, cfg, epoch=0)  # before DDP, which only syncs parameters that need gradients
    enable_gradient_checkpointing(model, cfg)
    compile_towers(model, cfg)
    step_module = wrap_for_training(
        TrainStep(model, objective, loss_mode=loss_mode), runtime,
        find_unused_parameters=cfg.distributed.find_unused_parameters,
    )
    loader, batches, clips_on_rank = build_train_loader(cfg, runtime, train_records, objective.strategy, tokenizer)
    steps_per_epoch = len(batches)
    observer = Observer(
        cfg.log,
        out_dir=cfg.out_dir,
        enabled=runtime.is_main,
        device=runtime.device,
        world_size=runtime.world_size,
        config=cfg.model_dump(mode="json"),
    )
    total_steps = min(cfg.optim.max_steps or math.inf, cfg.optim.epochs * steps_per_epoch)
    run = Run(
        cfg=cfg,
        runtime=runtime,
        model=model,
        objective=objective,
        step_module=step_module,
        tokenizer=tokenizer,
        optimizer=build_optimizer(step_module, model, cfg),
        scaler=make_grad_scaler(runtime),
        schedule=build_schedule(cfg, steps_per_epoch=steps_per_epoch, total_steps=int(total_steps)),
        loader=loader,
        batches=batches,
        context=LoopContext(
            model=model,
            tokenizer=tokenizer,
            train_records=train_records,
            data_cfg=cfg.data,
            frontend_cfg=cfg.frontend,
            batch_size=cfg.eval.batch_size,
            device=runtime.device,
            num_workers=loader_workers(cfg.data.num_workers),
            corpus=shard_corpus(cfg),
            autocast=lambda: autocast(runtime),  # KB passes under the run's AMP, as validation
        ),
        val_set=prepare_eval_set(val_records, data_cfg=cfg.data, frontend_cfg=cfg.frontend)
        if val_records
        else None,  # every rank embeds a share of it (training/validation.py)
        teachers=build_distillation_teachers(cfg, runtime, train_records, tokenizer),
        metrics=MetricsLog(cfg.out_dir / "metrics.jsonl", enabled=runtime.is_main, observer=observer),
        steps_per_epoch=steps_per_epoch,
        total_steps=int(total_steps),
        has_validation=bool(val_records),
        bad_samples=BadSampleBudget(
            max_fraction=cfg.data.max_bad_fraction, clips=clips_on_rank, replaced=cfg.data.shards is None
        ),
        observer=observer,
    )
    if resume_dir is not None:
        restore_trainer_state(run, resume_dir)
    else:
        run.metrics.truncate_after(0)
        if step0_checked:
            run.metrics.write(step0.metrics_record(step0_checked))
    if isinstance(batches, StreamBatches) and batches.coverage is not None:  # printed by the loader, kept here
        cover = batches.coverage
        run.metrics.write({"kind": "data_plan", "step": run.state.step, "clips": cover.clips,
                           "usable_clips": cover.usable, "clips_per_epoch": cover.served,
                           "coverage": round(cover.fraction, 6), "steps_per_epoch": cover.steps,
                           "world_size": runtime.world_size, "loader_workers": batches.stream.layout.workers})
    if runtime.is_main:
        (cfg.out_dir / "config.json").write_text(
            cfg.model_dump_json(indent=2) + "\n", encoding="utf-8"
        )
    log.info(
        "training on %d clips (%d val), %d steps/epoch, %d steps, %s, world size %d",
        len(train_records),
        len(val_records),
        steps_per_epoch,
        run.total_steps,
        runtime.device,
        runtime.world_size,
    )
    return run


def check_pretrained_start(
    cfg: TrainConfig, model: DualEncoder, tokenizer: Any, runtime: Runtime, *, resuming: bool
) -> list[step0.Step0Result]:
    """``model.step0_check``: a run from a pretrained folder stops here, before step 1, in one line when
    a tower does not start as the folder's own model (training/bundle/step0.py); every rank checks alike."""
    if not step0.applies(cfg, resuming=resuming):
        return []
    return step0.check_step0(model, cfg, tokenizer, runtime.device)


def build_train_loader(
    cfg: TrainConfig, runtime: Runtime, train_records: Sequence[Any], strategy: Any, tokenizer: Any
) -> tuple[Iterable[Any], EpochBatches | StreamBatches, int]:
    """(loader, its epoch batches, clips on this rank): the manifest's files, or ``data.shards`` streamed."""
    from training.data.dataset import TrainClipDataset, TrainCollate, TrainItem

    options = loader_options(
        cfg.data.num_workers,
        prefetch_factor=cfg.data.prefetch_factor,
        persistent=cfg.data.persistent_workers,
        cuda=runtime.device.type == "cuda",
    )
    if cfg.data.shards is not None:
        stream = build_stream_loader(
            cfg, cached_corpus(cfg), rank=runtime.rank, world=runtime.world_size, options=options,
            strategy=strategy, tokenizer=tokenizer, sample_rate=cfg.frontend.sample_rate,
            clip_samples=clip_samples(cfg.data, cfg.frontend),
        )
        return stream, stream, len(stream) * cfg.optim.batch_size
    dataset = TrainClipDataset(
        train_records,
        sample_rate=cfg.frontend.sample_rate,
        clip_samples=clip_samples(cfg.data, cfg.frontend),
        seed=cfg.seed,
        padding=short_clip_padding(cfg.frontend),
    )
    distributed.check_clips_per_rank(len(dataset), runtime.world_size)
    # drop_last: the epoch's tail (< world size clips) is skipped so every rank gets the same
    # number of batches and no clip appears twice in one global batch (docs/training.md).
    sampler: DistributedSampler[TrainItem] = DistributedSampler(
        dataset,
        num_replicas=runtime.world_size,
        rank=runtime.rank,
        shuffle=True,
        seed=cfg.seed,
        drop_last=True,
    )
    batches = EpochBatches(sampler, cfg.optim.batch_size)
    loader = DataLoader(
        dataset,
        batch_sampler=batches,
        collate_fn=TrainCollate(strategy, tokenizer, seed=cfg.seed),
        worker_init_fn=ignore_ctrl_c,
        generator=torch.Generator().manual_seed(cfg.seed),
        **options,
    )
    return loader, batches, len(sampler)


def shard_corpus(cfg: TrainConfig) -> Any | None:
    """The ``data.shards`` corpus the extra passes stream (training/data/shard_passes.py), else None."""
    if cfg.data.shards is None:
        return None
    return cached_corpus(cfg)


def load_training_data(cfg: TrainConfig) -> tuple[Sequence[Any], list[Any]]:
    """(train records, validation records), with clear errors for unusable manifests."""
    from training.data.manifest import load_manifest
    from training.data.splits import carves, select_split

    if cfg.data.shards is not None:  # docs/training.md, "Training on a large corpus"
        return load_shard_data(cfg)
    manifest = cfg.data.manifest
    if manifest is None:
        raise ConfigError("data.manifest is not set (e.g. data.manifest=data/small/manifest.jsonl)")
    if not manifest.is_file():
        raise DataError(f"manifest not found: {manifest} (data.manifest)")
    records = load_manifest(
        manifest,
        languages=cfg.data.languages,
        skip_missing_audio=cfg.data.skip_missing_audio,
        drop_other_languages=cfg.data.drop_other_languages,
    )
    data_cfg, eval_split = cfg.data, cfg.eval.split
    train = select_split(records, TRAIN_SPLIT, data_cfg=data_cfg, eval_split=eval_split)
    val = select_split(records, eval_split, data_cfg=data_cfg, eval_split=eval_split)
    train, val = train[: data_cfg.max_clips], val[: data_cfg.max_clips]
    if carves(eval_split, data_cfg=data_cfg, eval_split=eval_split):
        own = sum(r.split == cfg.eval.split for r in records)
        log.info(
            "validation: %d clips carved from train (data.val_fraction=%g)%s",
            len(val), cfg.data.val_fraction,
            f"; the manifest's own {own} {cfg.eval.split!r} clips are not used" if own else "",
        )
    if len(train) < 2:
        raise DataError(
            f"{manifest}: {len(train)} clip(s) in split {TRAIN_SPLIT!r}; training needs at least 2"
        )
    for split, records_of_split in ((TRAIN_SPLIT, train), (cfg.eval.split, val)):
        languages = cfg.data.languages
        missing = [
            lang for lang in languages if not any(r.captions.get(lang) for r in records_of_split)
        ]
        if records_of_split and missing:
            raise DataError(
                f"{manifest}: no {split!r} captions in {missing} although data.languages lists "
                f"them; set data.languages to the manifest's languages"
            )
    if cfg.eval.select_metric not in report_keys(cfg.data.languages):
        raise ConfigError(
            f"eval.select_metric {cfg.eval.select_metric!r} is not a report key; "
            f"e.g. t2a_R@10_mean, a2t_mAP@10_mean, mrv_t2a, t2a_R@1_{cfg.data.languages[0]}"
        )
    if not val:
        log.warning(
            "%s has no %r split: no validation; best/ will be the last weights",
            manifest,
            cfg.eval.split,
        )
    return train, val


def build_model(
    cfg: TrainConfig, records: Sequence[Any], runtime: Runtime, *, resume_dir: Path | None
) -> tuple[TrainConfig, DualEncoder, Any]:
    """(config, model, tokenizer): from `last/` when resuming, from `model.init_checkpoint`, or new.

    A model initialised from a checkpoint keeps that checkpoint's architecture and
    frontend, so the run's config is updated to describe the weights it saves.
    """
    from training.checkpoint import load_checkpoint
    from training.models.dual_encoder import build_dual_encoder

    source = resume_dir or cfg.model.init_checkpoint
    if source is not None:
        checkpoint = load_checkpoint(source)
        model_cfg = checkpoint.config.model.model_copy(
            update={"init_checkpoint": cfg.model.init_checkpoint}
        )
        if model_cfg != cfg.model or checkpoint.config.frontend != cfg.frontend:
            log.info("model and frontend settings taken from %s", source)
        cfg = cfg.model_copy(update={"model": model_cfg, "frontend": checkpoint.config.frontend})
        return cfg, checkpoint.model, checkpoint.tokenizer
    texts = caption_texts(records, cfg.data.languages)  # consumed on rank 0 only (data.shards: read again)
    tokenizer = build_tokenizer_once(cfg, texts, runtime)
    model = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=tokenizer.vocab_size)
    return cfg, model, tokenizer


def build_tokenizer_once(cfg: TrainConfig, texts: Iterable[str], runtime: Runtime) -> Any:
    """Rank 0 trains the tokenizer and the other ranks load its file, so every rank has the same vocabulary."""
    from index.bundle.tokenizer import TextTokenizer
    from training.models.tokenizer import build_tokenizer

    if not runtime.distributed:
        return build_tokenizer(cfg.model, texts)
    path = cfg.out_dir / "tokenizer.json"
    if runtime.is_main:
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        build_tokenizer(cfg.model, texts).save(path)
    barrier(runtime)
    return TextTokenizer.from_file(path)


class TrainStep(nn.Module):
    """Model + objective as one module: one forward from a batch to loss terms.

    One module so that DDP synchronises every gradient, the objective's learnable
    parameters (τ, SigLIP t/b, SVR radius...) included.
    """

    def __init__(
        self, model: DualEncoder, objective: Objective, *, loss_mode: distributed.LossMode = "global"
    ) -> None:
        super().__init__()
        self.model = model
        self.objective = objective
        self.loss_mode = loss_mode

    def forward(
        self,
        waveform: Tensor,
        input_ids: Tensor,
        attention_mask: Tensor,
        text_mask: Tensor,
        clip_index: Tensor | None = None,
        teacher_audio: Tensor | None = None,
        teacher_text: Tensor | None = None,
        *,
        audio_grad: Tensor | None = None,
        text_grad: Tensor | None = None,
        objective_grads: dict[str, Tensor] | None = None,
    ) -> dict[str, Tensor]:
        """Loss terms of the batch; with `audio_grad`/`text_grad` (gradient accumulation,
        training/accumulate.py) the surrogate whose gradient is the cached one instead."""
        audio, text = self.embed(waveform, input_ids, attention_mask, text_mask)
        if audio_grad is not None and text_grad is not None:
            return {
                "surrogate": surrogate(audio, text, audio_grad, text_grad, self.objective, objective_grads)
            }
        assert clip_index is not None
        return self.score(audio, text, text_mask, clip_index, teacher_audio, teacher_text)

    def embed(
        self, waveform: Tensor, input_ids: Tensor, attention_mask: Tensor, text_mask: Tensor
    ) -> tuple[Tensor, Tensor]:
        """(audio (B, d), text (V, B, d)) embeddings of this rank's rows."""
        return self.model.encode_audio(waveform), self._embed_views(input_ids, attention_mask, text_mask)

    def score(
        self,
        audio: Tensor,
        text: Tensor,
        text_mask: Tensor,
        clip_index: Tensor,
        teacher_audio: Tensor | None = None,
        teacher_text: Tensor | None = None,
    ) -> dict[str, Tensor]:
        """The objective's terms on these embeddings; under torchrun on the global batch."""
        batch = EmbeddingBatch(
            audio=audio,
            text=text,
            text_mask=text_mask,
            clip_index=clip_index,
            teacher_audio=teacher_audio,
            teacher_text=teacher_text,
        )
        # Under torchrun the objective sees the global batch (identity on one process).
        return self.objective(distributed.gather_embedding_batch(batch, mode=self.loss_mode))

    def _embed_views(self, input_ids: Tensor, attention_mask: Tensor, text_mask: Tensor) -> Tensor:
        """(V, B, d) text embeddings; missing views (text_mask False) stay zero and are never encoded."""
        views, batch, length = input_ids.shape
        rows = text_mask.reshape(-1).nonzero().squeeze(1)
        emb = self.model.encode_text(
            input_ids.reshape(-1, length)[rows], attention_mask.reshape(-1, length)[rows]
        )
        full = emb.new_zeros(views * batch, emb.shape[-1]).index_copy(0, rows, emb)
        return full.reshape(views, batch, -1)


def wrap_for_training(
    module: nn.Module, runtime: Runtime, *, find_unused_parameters: bool = False
) -> nn.Module:
    """DDP when launched with several processes; the module itself otherwise.

    Every trainable parameter gets a gradient in every step of the built-in objectives, so
    DDP skips its per-step search of the autograd graph for unused parameters (a full
    traversal each backward) unless ``distributed.find_unused_parameters`` asks for it;
    :func:`unused_parameter_hint` turns DDP's complaint into a one-line config error.
    BatchNorm becomes SyncBatchNorm (statistics over the global batch) on CUDA when the
    model has BatchNorm at all.
    """
    if not runtime.distributed:
        return module
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [runtime.device.index] if runtime.device.type == "cuda" else None
    has_batchnorm = any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())
    if runtime.device.type == "cuda" and has_batchnorm:  # SyncBatchNorm runs on NCCL only
        module = nn.SyncBatchNorm.convert_sync_batchnorm(module)
    return DistributedDataParallel(
        module, device_ids=device_ids, find_unused_parameters=find_unused_parameters
    )


@contextlib.contextmanager
def unused_parameter_hint() -> Iterator[None]:
    """DDP's error about parameters that got no gradient, as a ConfigError naming the setting."""
    try:
        yield
    except RuntimeError as err:
        if "find_unused_parameters" not in str(err):
            raise
        raise ConfigError(
            "distributed: a trainable parameter received no gradient in the previous step (an "
            "objective or tower that skips some parameters); set distributed.find_unused_parameters"
            "=true (slower: DDP then searches the graph every step) or freeze those parameters. "
            f"DDP said: {str(err).strip().splitlines()[0]}"
        ) from err


def build_optimizer(module: nn.Module, model: nn.Module, cfg: TrainConfig) -> torch.optim.Optimizer:
    """AdamW over per-tower groups (training/finetune.py): learning-rate scale and weight decay per
    tower, none on biases, norms and scalars such as temperatures. Frozen parameters are
    included (they get no gradient, so AdamW leaves them alone) so that unfreezing needs no rebuild."""
    return torch.optim.AdamW(parameter_groups(module, model, cfg), lr=cfg.optim.lr, betas=cfg.optim.betas)


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel wrapper (the module itself otherwise)."""
    return module.module if isinstance(module, torch.nn.parallel.DistributedDataParallel) else module


def build_schedule(cfg: TrainConfig, *, steps_per_epoch: int, total_steps: int) -> Schedule:
    return Schedule(
        base_lr=cfg.optim.lr,
        total_steps=total_steps,
        warmup_steps=cfg.optim.warmup_steps,
        kind=cfg.optim.schedule,
        step_size=cfg.optim.step_size_epochs * steps_per_epoch,
        gamma=cfg.optim.step_gamma,
    )


def build_distillation_teachers(
    cfg: TrainConfig, runtime: Runtime, records: Sequence[Any], tokenizer: Any
) -> Any | None:
    """Frozen teachers for `objective.distill` (SPEC §4.4), built once; None otherwise."""
    if cfg.objective.distill is None:
        return None
    from training.teachers import build_teachers

    return build_teachers(
        cfg.objective.distill,
        device=runtime.device,
        train_records=records,
        tokenizer=tokenizer,
        frontend=cfg.frontend,
        data=cfg.data,
        autocast=lambda: autocast(runtime),
    )


# --- loop -------------------------------------------------------------------------------------


def run_epochs(
    run: Run, *, interrupt_after_steps: int | None = None, stop: StopRequest | None = None
) -> None:
    """The training loop."""
    from tqdm import tqdm

    cfg, state = run.cfg, run.state
    stop = stop or StopRequest()
    for epoch in range(state.epoch, cfg.optim.epochs):
        if state.step >= run.total_steps:
            break
        begin_epoch(run, epoch)
        started = time.monotonic()
        bar = tqdm(
            total=run.steps_per_epoch,
            initial=state.batch_in_epoch,
            desc=f"epoch {epoch + 1}/{cfg.optim.epochs}",
            disable=not run.runtime.is_main,
            leave=False,
            dynamic_ncols=True,
        )
        try:
            for batch in run.observer.batches(run.loader):
                run.bad_samples.add(batch.skipped)
                if isinstance(run.batches, StreamBatches):  # ranks agree on the batch's clips
                    batch = run.batches.lockstep(batch)
                    if batch is None:  # a rank has < 2 usable clips: every rank skips the step
                        state.batch_in_epoch += 1
                        continue
                values = train_step(run, batch)
                record_step(run, epoch, values)
                bar.update()
                bar.set_postfix(loss=f"{values['loss']:.3f}", lr=f"{values['lr']:.2e}")
                if state.step >= run.total_steps or state.step == interrupt_after_steps:
                    break
                if periodic_save_due(run):
                    save_last(run)
                if stop_requested(run, stop):
                    break
        finally:
            bar.close()
        if state.step == interrupt_after_steps and state.step < run.total_steps:
            save_last(run)
            return
        if stop.requested and state.batch_in_epoch < run.steps_per_epoch and state.step < run.total_steps:
            save_last(run)
            raise TrainingInterrupted(
                step=state.step, epoch=state.epoch, batch_in_epoch=state.batch_in_epoch
            )
        end_epoch(run, epoch, seconds=time.monotonic() - started)
        if stop_requested(run, stop) and state.step < run.total_steps:  # last/ was just saved
            raise TrainingInterrupted(step=state.step, epoch=state.epoch, batch_in_epoch=0)
    finish(run)


def stop_requested(run: Run, stop: StopRequest) -> bool:
    """Whether to stop at this step boundary; all ranks agree, so none waits alone in a collective."""
    if not run.runtime.distributed:
        return stop.requested
    stop.requested = distributed.any_rank(stop.requested)
    return stop.requested


def begin_epoch(run: Run, epoch: int) -> None:
    """Seed this epoch's shuffling, cropping and caption sampling; call the objective's hook."""
    state = run.state
    # keys carry the epoch to the workers; a resume continues at its place in the global order
    run.batches.set_epoch(epoch, skip=state.batch_in_epoch, samples_in_epoch=state.samples_in_epoch)
    state.batch_in_epoch, state.samples_in_epoch = run.batches.batches_before(), None
    run.context.epoch, run.context.step = epoch, run.state.step
    run.objective.on_epoch_start(run.context)
    if apply_freezing(run.model, run.cfg, epoch=epoch):  # optim.*.unfreeze_after_epochs
        log.info("epoch %d: trainable towers changed (optim.*.freeze / unfreeze_after_epochs)", epoch + 1)
        run.model.train()  # BatchNorm layers that were frozen leave eval mode
        if run.runtime.distributed:  # DDP fixed its set of synchronised parameters when built
            run.step_module = wrap_for_training(
                unwrap(run.step_module), run.runtime,
                find_unused_parameters=run.cfg.distributed.find_unused_parameters,
            )


def train_step(run: Run, batch: Any) -> dict[str, float]:
    """One optimizer step; returns the learning rate, loss, gradient norm and every term.

    The logged numbers leave the device once per step: loss, gradient norm and terms are
    stacked into one tensor, averaged over ranks in one all-reduce and copied to the host
    in one transfer (:func:`distributed.reduce_logged`). A non-finite loss on any rank is
    therefore seen by every rank before the optimizer steps, and all stop together.
    """
    cfg, state = run.cfg, run.state
    lr = run.schedule(state.step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    run.context.step = state.step
    run.objective.on_step_start(run.context)
    inputs = batch_inputs(run, batch)
    run.optimizer.zero_grad(set_to_none=True)
    terms, loss = forward_backward(run, inputs)
    run.scaler.unscale_(run.optimizer)
    params = [p for group in run.optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip or math.inf)
    logged = distributed.reduce_logged({"loss": loss, "grad_norm": grad_norm, **terms})
    if not math.isfinite(logged["loss"]):
        raise FloatingPointError(
            f"loss is {logged['loss']} at step {state.step}; lower optim.lr or enable grad_clip"
        )
    run.scaler.step(run.optimizer)
    run.scaler.update()
    state.step += 1
    state.batch_in_epoch += 1
    return {"lr": lr, **logged}


def forward_backward(run: Run, inputs: dict[str, Tensor | None]) -> tuple[dict[str, Tensor], Tensor]:
    """(terms, loss) of the batch, with the gradients of the (scaled) loss accumulated.

    With ``optim.accum_steps`` N > 1 the batch goes through the towers in N micro-batches
    while the objective still sees it whole (training/accumulate.py).
    """
    with unused_parameter_hint():
        if run.cfg.optim.accum_steps > 1:
            return accumulated_backward(
                run.step_module, inputs, run.cfg.optim.accum_steps,
                autocast=lambda: autocast(run.runtime), scale=run.scaler.scale, device=run.runtime.device,
            )
        with autocast(run.runtime):
            terms = run.step_module(**inputs)
            loss = total_loss(terms)
        run.scaler.scale(loss).backward()
    return terms, loss


def batch_inputs(run: Run, batch: Any) -> dict[str, Tensor | None]:
    """Device tensors for :class:`TrainStep`, with teacher embeddings when distilling."""
    device = run.runtime.device
    inputs: dict[str, Tensor | None] = {
        name: torch.as_tensor(getattr(batch, name)).to(device, non_blocking=True)
        for name in ("waveform", "input_ids", "attention_mask", "text_mask", "clip_index")
    }
    if run.teachers is not None:
        teacher_audio, teacher_text = run.teachers.embed(batch)
        inputs["teacher_audio"], inputs["teacher_text"] = (
            teacher_audio.to(device),
            teacher_text.to(device),
        )
    return inputs


def record_step(run: Run, epoch: int, values: dict[str, float]) -> None:
    state = run.state
    state.epoch_loss_sum += values["loss"]
    state.epoch_loss_count += 1
    run.observer.step_end()
    if state.step == 1 or state.step % LOG_EVERY_STEPS == 0:
        values = {**values, **run.observer.window()}  # samples/s, data wait, peak memory
        run.metrics.write({"kind": "step", "epoch": epoch + 1, "step": state.step, **values})


def validate(run: Run) -> dict[str, float] | None:
    """SPEC §5 report on the validation split, every rank embedding its share; rank 0 gets the
    report and writes it, the others get None (:func:`training.validation.evaluate_shared`)."""
    if run.val_set is None:
        return None
    report = evaluate_shared(
        run.model, run.tokenizer, run.val_set, batch_size=run.cfg.eval.batch_size, device=run.runtime.device,
        num_workers=loader_workers(run.cfg.data.num_workers), autocast=lambda: autocast(run.runtime),
        progress=run.runtime.is_main,
    )
    if report is None:
        return None
    if run.cfg.eval.select_metric not in report:
        raise ConfigError(
            f"eval.select_metric {run.cfg.eval.select_metric!r} is not a report key; "
            f"e.g. {', '.join(sorted(report)[:6])}"
        )
    run.metrics.write({"kind": "eval", "epoch": run.state.epoch, "step": run.state.step, **report})
    return report


def end_epoch(run: Run, epoch: int, *, seconds: float) -> None:
    """Log the epoch, validate when due, save `best/` and `last/`, redraw the curves."""
    cfg, state = run.cfg, run.state
    summary = {k: float(v) for k, v in run.objective.epoch_summary().items()}
    if run.teachers is not None:
        summary.update(run.teachers.cache_stats())
    mean_loss = state.epoch_loss_sum / max(1, state.epoch_loss_count)
    run.metrics.write(
        {
            "kind": "epoch",
            "epoch": epoch + 1,
            "step": state.step,
            "loss": mean_loss,
            "seconds": seconds,
            **epoch_data_metrics(run),
            **summary,
        }
    )
    state.epoch, state.batch_in_epoch = epoch + 1, 0
    state.epoch_loss_sum, state.epoch_loss_count = 0.0, 0
    is_last = state.epoch == cfg.optim.epochs or state.step >= run.total_steps
    report = validate(run) if (state.epoch % cfg.eval.every_epochs == 0 or is_last) else None
    if report is not None and improves(run, report):
        save_checkpoint_dir(run, "best", report)
    save_last(run, report)
    log.info(
        "epoch %d: loss %.4f (%.0f s)%s",
        state.epoch,
        mean_loss,
        seconds,
        f", {cfg.eval.select_metric} {report[cfg.eval.select_metric]:.4f}" if report else "",
    )
    if run.runtime.is_main:
        run.metrics.plot(cfg.out_dir / "curves.png")


def epoch_data_metrics(run: Run) -> dict[str, int]:
    """The epoch's data counts over every rank (every rank calls this): bad samples (distinct, the run's),
    clips served and held back (totals), each with its worst rank beside it (docs/training.md)."""
    local: dict[str, float] = {"bad_samples": run.bad_samples.count}
    if isinstance(run.batches, StreamBatches):
        local.update(run.batches.epoch_stats())
    reduced = distributed.reduce_counts(
        local, worst={"bad_samples": "max", "clips_served": "min", "clips_held_back": "max"}
    )
    reduced["bad_samples"] = distributed.distinct_over_ranks(list(run.bad_samples.seen))
    return {key: int(value) for key, value in reduced.items()}


def improves(run: Run, report: dict[str, float]) -> bool:
    """Update the best value when `report` beats it on `eval.select_metric`."""
    name, state = run.cfg.eval.select_metric, run.state
    value = report[name]
    lower = name.startswith(LOWER_IS_BETTER)
    better = state.best_value is None or (
        value < state.best_value if lower else value > state.best_value
    )
    if better and math.isfinite(value):
        state.best_value, state.best_step = value, state.step
        return True
    return False


def finish(run: Run) -> None:
    """Without validation data the final weights are also `best/`."""
    if not run.has_validation and run.state.best_step is None:
        run.state.best_step = run.state.step
        save_checkpoint_dir(run, "best", None)
        save_last(run)
    run.observer.close()
    log.info("done: %d steps; checkpoints in %s", run.state.step, run.cfg.out_dir)


# --- checkpoints --------------------------------------------------------------------------


def save_checkpoint_dir(run: Run, name: str, report: dict[str, float] | None) -> Path:
    """Write `out_dir/NAME` with the model, config and tokenizer (rank 0 only)."""
    from training.checkpoint import save_checkpoint

    directory = run.cfg.out_dir / name
    if run.runtime.is_main:
        state = {
            "epoch": run.state.epoch,
            "step": run.state.step,
            "select_metric": run.cfg.eval.select_metric,
            "metrics": report,
        }
        save_checkpoint(
            directory, model=run.model, config=run.cfg, tokenizer=run.tokenizer, state=state
        )
    return directory


def periodic_save_due(run: Run) -> bool:
    """`save_every_steps`: a mid-epoch `last/` (the epoch's end saves one anyway)."""
    every, state = run.cfg.save_every_steps, run.state
    return bool(
        every
        and state.step % every == 0
        and state.batch_in_epoch < run.steps_per_epoch
        and state.step < run.total_steps
    )


def save_last(run: Run, report: dict[str, float] | None = None) -> None:
    """`last/` plus the optimizer, scaler, objective, RNG and loop state for an exact resume.

    Written whole into a temporary sibling and renamed over `last/`: a crash while saving
    leaves the previous `last/` intact.
    """
    from training.checkpoint import replace_dir

    state = run.state
    in_epoch = state.batch_in_epoch > 0 and run.batches.epoch == state.epoch
    state.samples_in_epoch = run.batches.samples_consumed(state.batch_in_epoch) if in_epoch else 0
    directory = save_checkpoint_dir(run, ".last.partial", report)
    rng_tensors, rng_meta = distributed.rank_rng_states(capture_rng_state())
    if isinstance(run.batches, StreamBatches):
        run.batches.gather_extra(state.epoch, state.batch_in_epoch)  # every rank's reserve draws, for rank 0's plan
    budget = run.bad_samples.gather_state()  # every rank's bad samples: the budget survives a resume
    if run.runtime.is_main:
        optim_tensors, optim_meta = flatten_optimizer_state(run.optimizer.state_dict())
        objective_tensors = {
            f"objective.{k}": v.detach().cpu() for k, v in run.objective.state_dict().items()
        }
        meta = {
            "loop": asdict(run.state),
            "optimizer": optim_meta,
            "rng": rng_meta,
            "scaler": run.scaler.state_dict(),
            "world_size": run.runtime.world_size,
            "bad_samples": budget,
        }
        if isinstance(run.batches, StreamBatches):
            meta["data_plan"] = run.batches.plan_state(state.epoch, state.batch_in_epoch)
        save_trainer_state(
            directory, tensors={**optim_tensors, **rng_tensors, **objective_tensors}, meta=meta
        )
        replace_dir(directory, run.cfg.out_dir / "last")
    barrier(run.runtime)
    if run.runtime.is_main and 0 < state.batch_in_epoch < run.steps_per_epoch:
        log.info(
            "saved %s at step %d (epoch %d, batch %d of %d)",
            run.cfg.out_dir / "last", state.step, state.epoch + 1, state.batch_in_epoch,
            run.steps_per_epoch,
        )


def restore_trainer_state(run: Run, directory: Path) -> None:
    """Inverse of :func:`save_last` (the model weights were already loaded by :func:`build_model`)."""
    tensors, meta = load_trainer_state(directory)
    run.optimizer.load_state_dict(unflatten_optimizer_state(tensors, meta["optimizer"]))
    prefix = "objective."
    run.objective.load_state_dict(
        {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    )
    if meta["scaler"]:
        run.scaler.load_state_dict(meta["scaler"])
    run.state = LoopState(**meta["loop"])
    saved_world, world = int(meta.get("world_size", 1)), run.runtime.world_size
    if isinstance(run.batches, StreamBatches):
        restore_stream_plan(run, meta.get("data_plan"), saved_world=saved_world)
    elif saved_world != world:
        # Same global clip order, continued from the clips consumed (training/elastic.py).
        state, batch = run.state, run.cfg.optim.batch_size
        if state.samples_in_epoch is None:
            state.samples_in_epoch = state.batch_in_epoch * batch * saved_world
        # Steps per epoch follow the world size: the run ends with what the remaining clips
        # make at this one (the step counter and max_steps stay absolute).
        run.batches.set_epoch(state.epoch, samples_in_epoch=state.samples_in_epoch)
        left = len(run.batches.plan()) + (run.cfg.optim.epochs - state.epoch - 1) * run.steps_per_epoch
        run.total_steps = int(min(run.cfg.optim.max_steps or math.inf, state.step + left))
        run.schedule = build_schedule(
            run.cfg, steps_per_epoch=run.steps_per_epoch, total_steps=run.total_steps
        )
        log.info(
            "resume: world size changed %d -> %d: epoch %d continues at clip %d of its global order; "
            "global batch %d (was %d), %d steps/epoch, run ends at step %d; "
            "ranks >= %d re-seeded from (seed, step, rank)",
            saved_world, world, state.epoch + 1, state.samples_in_epoch, batch * world,
            batch * saved_world, run.steps_per_epoch, run.total_steps, saved_world,
        )
    run.bad_samples.restore_state(meta.get("bad_samples"), rank=run.runtime.rank, world=world)
    rng = resumed_rng_state(tensors, meta["rng"], saved_world=saved_world, rank=run.runtime.rank)
    if rng is not None:
        restore_rng_state(*rng)
    else:
        seed_everything(rederived_seed(run.cfg.seed, step=run.state.step, rank=run.runtime.rank))
    run.metrics.truncate_after(run.state.step)
    log.info("resumed from %s at epoch %d, step %d", directory, run.state.epoch, run.state.step)


def restore_stream_plan(run: Run, plan: dict[str, Any] | None, *, saved_world: int) -> None:
    """Take up the checkpoint's data plan (training/data/stream.py ``StreamBatches.restore``): the same
    layout resumes exactly; another one serves the epoch's clips not yet served, cut anew, and
    the run's step count follows."""
    assert isinstance(run.batches, StreamBatches)
    state = run.state
    said = run.batches.restore(plan, epoch=state.epoch, batch_in_epoch=state.batch_in_epoch, saved_world=saved_world)
    left = run.batches.remaining_steps() + (run.cfg.optim.epochs - state.epoch - 1) * run.steps_per_epoch
    total = int(min(run.cfg.optim.max_steps or math.inf, state.step + left))
    if total != run.total_steps:
        run.total_steps = total
        run.schedule = build_schedule(run.cfg, steps_per_epoch=run.steps_per_epoch, total_steps=total)
        said += f"; the run ends at step {total}"
    log.info("resume from shards: %s", said)


# --- batching and metrics files -----------------------------------------------------------


class MetricsLog:
    """Append-only ``metrics.jsonl`` (one JSON object per line) written by rank 0."""

    def __init__(self, path: Path, *, enabled: bool, observer: Observer | None = None) -> None:
        self.path = path
        self.enabled = enabled
        self.observer = observer  # also sends each record to TensorBoard / W&B
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict[str, Any]) -> None:
        if self.enabled:
            clean = {
                k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                for k, v in record.items()
            }
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(clean) + "\n")
            if self.observer is not None:
                self.observer.write(record)

    def records(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        return [
            json.loads(line)
            for line in self.path.read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]

    def truncate_after(self, step: int) -> None:
        """Drop records of steps after `step` (a resumed run redoes them); `0` starts afresh."""
        if self.enabled:
            if self.observer is not None:
                self.observer.restart_from(step)  # TensorBoard too
            kept = [r for r in self.records() if r.get("step", 0) <= step] if step else []
            self.path.write_text("".join(json.dumps(r) + "\n" for r in kept), encoding="utf-8")

    def plot(self, path: Path) -> None:
        from training.plots import plot_training_curves

        plot_training_curves(self.records(), path)
