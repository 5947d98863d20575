"""What a run holds per rank besides its data: the model, its optimizer, ASK's knowledge bases.

Used by ``tonearm train CONFIG --plan`` (:mod:`training.data.cluster_plan`). Every figure is
counted from the run's own objects or formulas, not guessed:

* **The model** is built from the run's config on the ``meta`` device (shapes only, no memory,
  no weights read): Hugging Face towers from their folder's ``config.json`` (transformers'
  default config of that class — e.g. ``ClapConfig()`` = laion/clap-htsat-unfused's size — when
  ``model.*.path`` is unset), a ``model.init_checkpoint``'s from its ``config.json``,
  ``hf_configs.json`` and ``tokenizer.json``; the built-in text tower at its full
  ``model.text.vocab_size``. The freezing of epoch 1 (``optim.audio/text.freeze``,
  ``unfrozen_layers``) is applied as the loop applies it (:func:`training.finetune.apply_freezing`).
* **Per rank on the GPU**, with the run's AdamW: fp32 parameters (autocast keeps fp32 weights),
  a fp32 gradient and two fp32 moments per *trainable* parameter (frozen ones get neither:
  AdamW keeps no state for a parameter without a gradient), and under DDP (world size > 1)
  its gradient buckets, one more fp32 copy of the gradients (``gradient_as_bucket_view`` is off,
  PyTorch's DDP documentation). Distillation teachers: their weights (fp32, frozen).
* **ASK's knowledge bases** (``objective.knowledge``, :mod:`training.knowledge`): the fine KB's
  text side holds every (clip, caption) pair of the sources — keys d fp32 + partner row and clip
  id (int64) — and its audio side one entry per clip (audio and mean-caption rows d fp32 each +
  two int64; on CUDA a side's keys are the other side's partners, one tensor); the coarse KB ``N_c``
  prototype pairs (2d fp32, a partner row per side and one shared id, int64). ``partition: auto`` at world size R > 1:
  each rank holds ~1/R of the fine rows; ``none``: all of them. A rebuild frees the old KBs and
  then holds, per local pair, the audio and text embeddings and their concatenation
  ``[u; v]`` (the coarse K-Means input; 16·d bytes a pair, the same as the embedding pass's
  lists and their ``torch.cat``), the concatenation also once on the host (FAISS labels every
  pair on the CPU), partitioned every pair's clip id (gathered and sorted, 16 B a pair), and on
  rank 0 the K-Means input (≤ 256·N_c pairs of 2d fp32) on GPU and host.
* **The corpus metadata** (``data.shards``, :func:`count_records`): every split's columns of
  records.jsonl (training/data/shard_records.py: ids, seconds, shard, ordinal, line offsets — their
  arrays' own bytes) and the ids of clips without a caption in ``data.languages`` (Python strings,
  ``sys.getsizeof`` each); the stream's per-shard ordinals, rows, byte offsets and sizes (four int64 per usable clip) and,
  in each loader worker, the epoch's sequence (two int64 more); the validation split extracted
  with its captions as :class:`ClipRecord` s, :data:`RECORDS_RSS_FACTOR` × its lines' bytes. The
  knowledge-base pass over the train shards reads the captions of this rank's share again, ~1/R of
  the train lines × the same factor, at a rebuild (:attr:`RecordsCount.pass_share`).
* Not counted: activations (they scale with batch, caption count and crop; measured figures in
  docs/BENCHMARKS.md ``gpu_real_size``), the CUDA context and allocator slack, the objective's
  own scalars (τ, …).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from training.config import ConfigError, ModelConfig, TrainConfig

FP32 = 4
INT64 = 8
RECORDS_RSS_FACTOR = 2.4
"""Resident bytes per byte of records.jsonl lines read into :class:`ClipRecord` s with their captions
(measured: 2.29× at 400 k clips × 8 languages × 5 captions, bench/records_memory.py)."""
SEQUENCE_BYTES = 2 * INT64
"""Bytes per usable clip of the epoch's sequence in each worker (shard, ordinal); the stream's per-shard plan
holds twice as much (ordinal, row, byte offset, size)."""
MAIN_PROCESS_PSS = 800 * 2**20
"""PSS of a training process besides what the plan counts item by item (the interpreter, torch and its
libraries, autograd's and the optimizer's working memory at a small model): 754-839 MiB measured on a quiet
machine (load < 1.1) in a small CPU run of the merged tree, bench/plan_pss.py (622-634 MiB in the first,
loaded runs). A GPU process adds its CUDA context
(not counted, docs/training.md)."""
WORKER_PSS = 16 * 2**20
"""PSS of one forked loader worker besides its shuffle buffer and batches (its own pages: the decoder's
buffers, the Python objects it touched); the sum over a run's process tree grew by ~11 MiB a worker
from 1 to 3 workers (training and validation, bench/plan_pss.py)."""
PROCESS_BASELINE_ENV = "TONEARM_PROCESS_BASELINE"
"""A calibration file (:func:`read_process_baseline`) the run's node check at start reads when no
``--process-baseline`` is given (the plan reads it too)."""


@dataclass(frozen=True)
class ProcessBaseline:
    """The processes' own memory the plan counts per rank: the training process's PSS besides what the
    plan counts item by item, and each loader worker's. The defaults (:data:`MAIN_PROCESS_PSS`,
    :data:`WORKER_PSS`) were measured on one machine; a process's own memory depends on the machine and
    the installation (torch's libraries above all: the review found the plan 1.70–2.07× a run's PSS
    elsewhere), so ``python -m training.memory_calibration`` measures it where the run will run and
    writes a file for ``tonearm train --plan --process-baseline FILE`` (docs/training.md)."""

    main: int = MAIN_PROCESS_PSS
    worker: int = WORKER_PSS
    source: str = "default: measured on one machine (calibrate with `python -m training.memory_calibration`)"

    def processes(self, workers: int) -> int:
        """A rank's processes: the training process and 2 × ``workers`` loader workers (validation
        starts as many again beside the persistent training workers)."""
        return self.main + 2 * workers * self.worker


def read_process_baseline(path: str | Path | None = None) -> ProcessBaseline:
    """The baseline of a calibration file (``path``, else ``$TONEARM_PROCESS_BASELINE``), else the default."""
    import os

    path = path or os.environ.get(PROCESS_BASELINE_ENV)
    if not path:
        return ProcessBaseline()
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        return ProcessBaseline(main=int(data["main_pss"]), worker=int(data["worker_pss"]),
                               source=f"calibrated: {path} ({data.get('machine', '?')}, {data.get('when', '?')})")
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"{path}: not a process calibration of `python -m training.memory_calibration` ({err})") \
            from None


KMEANS_POINTS_PER_CENTROID = 256
"""training.knowledge.KMEANS_POINTS_PER_CENTROID (not imported: that module imports faiss)."""
DEFAULT_HF_CONFIG = {"hf_clap": "ClapConfig", "hf_ast": "ASTConfig", "hf_pe_audio": "PeAudioConfig"}
"""transformers config class whose defaults give a tower kind's full size when its path is unset."""


@dataclass(frozen=True)
class ModelCount:
    parameters: int
    trainable: int
    embed_dim: int
    notes: tuple[str, ...] = ()

    def gpu_bytes(self, *, world: int) -> dict[str, int]:
        """Per rank: parameters, gradients (+ DDP buckets when world > 1), AdamW moments."""
        grads = self.trainable * FP32 * (2 if world > 1 else 1)
        return {"parameters": self.parameters * FP32, "gradients": grads, "adamw": 2 * self.trainable * FP32}


def _hf_config(kind: str, path: str | None, *, key: str, notes: list[str]) -> dict[str, Any]:
    """The full transformers config dict a tower of ``kind`` at ``path`` is built from."""
    import transformers

    if path is None:
        if kind not in DEFAULT_HF_CONFIG:
            raise ConfigError(f"--plan counts the model from {key}'s config.json: set {key}")
        name = DEFAULT_HF_CONFIG[kind]
        notes.append(f"{key} unset: counted at transformers' default {name}()")
        return dict(getattr(transformers, name)().to_dict())
    folder = Path(path).expanduser()
    try:
        if (folder / "config.json").is_file():
            model_type = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("model_type")
            if kind == "hf_pe_audio" and model_type == "pe_audio_video":  # the audio branch is what trains
                return dict(transformers.PeAudioVideoConfig.from_pretrained(folder).audio_config.to_dict())
        return dict(transformers.AutoConfig.from_pretrained(path).to_dict())
    except (OSError, ValueError, TypeError) as err:
        raise ConfigError(f"--plan: {key} {path!r}: cannot read its config.json ({str(err).splitlines()[0]})") from None


def hf_configs_for(model_cfg: ModelConfig, notes: list[str]) -> dict[str, dict[str, Any]]:
    """``hf_configs`` for :func:`build_dual_encoder`: each Hugging Face tower's config, no weights."""
    audio, text = model_cfg.audio, model_cfg.text
    configs: dict[str, dict[str, Any]] = {}
    if audio.kind != "cnn":
        configs["audio"] = _hf_config(audio.kind, audio.path, key="model.audio.path", notes=notes)
    paired = audio.kind in ("hf_clap", "hf_pe_audio") and text.kind == audio.kind and text.path in (None, audio.path)
    if paired:
        configs["text"] = configs["audio"]
    elif text.kind != "builtin":
        configs["text"] = _hf_config(text.kind, text.path, key="model.text.path", notes=notes)
    return configs


def _checkpoint_model(folder: Path, key: str) -> tuple[ModelConfig, Any, dict[str, dict[str, Any]], int]:
    """(model config, frontend config, hf_configs, vocabulary) of a checkpoint directory, no weights read."""
    from index.bundle.tokenizer import TextTokenizer

    try:
        saved = TrainConfig.model_validate(json.loads((folder / "config.json").read_text(encoding="utf-8")))
        hf = folder / "hf_configs.json"
        configs = json.loads(hf.read_text(encoding="utf-8")) if hf.is_file() else {}
        vocab = TextTokenizer.from_file(folder / "tokenizer.json").vocab_size
    except (OSError, ValueError) as err:
        raise ConfigError(f"--plan: {key} {folder}: cannot read its config, hf_configs or tokenizer ({err})") from None
    return saved.model, saved.frontend, configs, int(vocab)


def count_model(cfg: TrainConfig) -> ModelCount:
    """Parameters of the run's dual encoder and how many train in epoch 1 (module doc)."""
    import torch

    from training.finetune import apply_freezing
    from training.models.dual_encoder import build_dual_encoder

    notes: list[str] = []
    model_cfg, frontend, vocab = cfg.model, cfg.frontend, cfg.model.text.vocab_size
    if cfg.model.init_checkpoint is not None:
        model_cfg, frontend, configs, vocab = _checkpoint_model(Path(cfg.model.init_checkpoint),
                                                                "model.init_checkpoint")
        notes.append(f"architecture of model.init_checkpoint {cfg.model.init_checkpoint}")
    else:
        configs = hf_configs_for(model_cfg, notes)
    with torch.device("meta"):
        model = build_dual_encoder(model_cfg, frontend, vocab_size=vocab, hf_configs=configs)
    apply_freezing(model, cfg.model_copy(update={"model": model_cfg}), epoch=0)
    parameters = list(model.parameters())
    return ModelCount(parameters=sum(p.numel() for p in parameters),
                      trainable=sum(p.numel() for p in parameters if p.requires_grad), embed_dim=model_cfg.embed_dim,
                      notes=tuple(notes))


def teacher_parameters(cfg: TrainConfig) -> int:
    """Parameters of the distillation teachers (frozen, each rank holds all of them), from their
    ``model.safetensors`` headers; 0 without ``objective.distill``."""
    from safetensors import safe_open

    spec = cfg.objective.distill
    if not spec:
        return 0
    total = 0
    for teacher in spec.get("teachers", []):
        weights = Path(teacher) / "model.safetensors"
        try:
            with safe_open(str(weights), framework="np") as handle:
                for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    shape = handle.get_slice(name).get_shape()
                    count = 1
                    for size in shape:
                        count *= int(size)
                    total += count
        except (OSError, ValueError) as err:
            raise ConfigError(f"--plan: objective.distill.teachers: cannot read {weights} ({err})") from None
    return total


@dataclass(frozen=True)
class KnowledgeCount:
    """ASK's knowledge bases of a run, per rank (module doc)."""

    pairs: int
    clips: int
    dim: int
    share: int
    """Ranks the fine KB is split over (1 with ``partition: none`` or at world size 1)."""
    fine: bool
    coarse: bool
    clusters: int

    @property
    def local_pairs(self) -> int:
        return -(-self.pairs // self.share)

    @property
    def local_clips(self) -> int:
        return -(-self.clips // self.share)

    @property
    def kmeans_points(self) -> int:
        return min(self.pairs, KMEANS_POINTS_PER_CENTROID * self.clusters) if self.coarse else 0

    def gpu_resident(self) -> int:
        """Bytes the KBs hold on each rank's GPU between rebuilds."""
        d = self.dim
        fine = (self.local_pairs * (d * FP32 + 2 * INT64) + self.local_clips * (2 * d * FP32 + 2 * INT64)
                if self.fine else 0)
        coarse = min(self.clusters, self.pairs) * (2 * d * FP32 + 3 * INT64) if self.coarse else 0
        return fine + coarse

    def gpu_rebuild(self, *, rank0: bool) -> int:
        """Bytes on a rank's GPU at the peak of a rebuild (the old KBs are freed first)."""
        d = self.dim
        pairs = self.local_pairs * (4 * d * FP32 + 4 * INT64)  # u, v, [u; v] (or the pass's lists + cat), ids
        clips = self.local_clips * (2 * d * FP32 + 2 * INT64) if self.fine else 0
        gathered = self.kmeans_points * 2 * d * FP32 if rank0 and self.share > 1 else 0
        ids = self.pairs * 2 * INT64 if self.share > 1 else 0  # every pair's clip id, gathered and sorted
        return pairs + clips + gathered + ids

    def host_rebuild(self, *, rank0: bool) -> int:
        """Bytes on a rank's host at a rebuild: [u; v] of its pairs for FAISS, and rank 0's K-Means input."""
        if not self.coarse:
            return 0
        return self.local_pairs * 2 * self.dim * FP32 + (self.kmeans_points * 2 * self.dim * FP32 if rank0 else 0)


def count_knowledge(cfg: TrainConfig, *, embed_dim: int, train_pairs: int, train_clips: int,
                    world: int) -> KnowledgeCount | None:
    """The knowledge bases of ``objective.knowledge`` (None without one); extra ``sources`` manifests
    are read to count their pairs."""
    from training.objectives.ask import TRAIN_SOURCE, parse_knowledge_config

    spec = cfg.objective.knowledge
    if not spec:
        return None
    ask = parse_knowledge_config(spec)
    pairs = clips = 0
    for source in ask.sources:
        if source == TRAIN_SOURCE:
            pairs, clips = pairs + train_pairs, clips + train_clips
            continue
        from training.data.manifest import load_manifest

        records = load_manifest(Path(source), languages=cfg.data.languages, skip_missing_audio=False,
                                drop_other_languages=cfg.data.drop_other_languages)
        clips += len(records)
        pairs += sum(len(texts) for r in records for texts in r.captions.values())
    share = world if ask.partition == "auto" and world > 1 else 1
    return KnowledgeCount(pairs=pairs, clips=clips, dim=embed_dim, share=share, fine=ask.fine, coarse=ask.coarse,
                          clusters=ask.n_clusters)


@dataclass(frozen=True)
class RecordsCount:
    """What a rank holds of records.jsonl (module doc), in bytes."""

    columns: int
    """Every split's columns and the unusable clips' ids."""
    plan: int
    """The stream's per-shard ordinals and rows."""
    sequences: int
    """The epoch's sequence, in every loader worker."""
    validation: int
    """The validation split as records with their captions."""
    pass_share: int
    """At a knowledge-base pass over the train shards: the captions of this rank's share."""

    @property
    def resident(self) -> int:
        return self.columns + self.plan + self.sequences + self.validation


def count_records(corpus: Any, *, eval_split: str, workers: int, world: int, knowledge_pass: bool) -> RecordsCount:
    """:class:`RecordsCount` of a :class:`training.data.stream.ShardCorpus` as a run reads it."""
    import sys

    from training.data.splits import TRAIN_SPLIT

    splits = corpus.records
    train = splits.get(TRAIN_SPLIT)
    usable = len(train) if train is not None else 0
    unusable = sum(sys.getsizeof(i) + 8 for records in splits.values() for i in records.unusable)
    val = splits.get(eval_split) if eval_split != TRAIN_SPLIT else None
    share = -(-train.line_bytes // max(1, world)) if train is not None and knowledge_pass else 0
    return RecordsCount(columns=sum(records.nbytes for records in splits.values()) + unusable,
                        plan=2 * SEQUENCE_BYTES * usable, sequences=SEQUENCE_BYTES * usable * max(1, workers),
                        validation=int(RECORDS_RSS_FACTOR * val.line_bytes) if val is not None else 0,
                        pass_share=int(RECORDS_RSS_FACTOR * share))
