"""Embed a held-out split with a dual encoder and score it with the SPEC §5 metrics.

The evaluator only embeds and delegates: captions through the tokenizer and text
tower; audio through ``eval_audio_chunks`` (center crop or chunk-and-average, SPEC §2)
and the audio tower, chunk embeddings averaged and re-normalized per clip; the
numbers come from :func:`index.metrics.retrieval_report`.

``tonearm evaluate CHECKPOINT --data MANIFEST --split test [--out DIR]`` writes
``report.json``, ``report.md`` and ``languages.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from index.tokenizer import TextTokenizer
from tonearm.errors import DataError
from training.config import DataConfig, FrontendConfig
from training.data.dataset import EvalCaptions, eval_audio_chunks, eval_captions
from training.data.manifest import ClipRecord
from training.runtime import eval_mode

log = logging.getLogger(__name__)


@dataclass
class EvalSet:
    """A split ready to embed: decoded audio chunks per clip and the caption queries."""

    chunks: list[np.ndarray]
    """Per clip, (C, n) float32 chunks (C = 1 for a center crop)."""
    captions: EvalCaptions
    languages: tuple[str, ...]


def clip_samples(data_cfg: DataConfig, frontend_cfg: FrontendConfig) -> int:
    """Samples per training crop / evaluation chunk."""
    return int(round(data_cfg.clip_seconds * frontend_cfg.sample_rate))


def progress_bar(total: int, description: str, *, enabled: bool) -> Any:
    """A transient tqdm bar on stderr (a no-op object when disabled)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=description, disable=not enabled, leave=False, dynamic_ncols=True)


def load_clip_chunks(
    records: Sequence[ClipRecord],
    *,
    data_cfg: DataConfig,
    frontend_cfg: FrontendConfig,
    progress: bool = False,
) -> list[np.ndarray]:
    """Decode every clip into its evaluation chunks (the `data.eval_crop` policy)."""
    n = clip_samples(data_cfg, frontend_cfg)
    chunks = []
    with progress_bar(len(records), "decoding clips", enabled=progress) as bar:
        for record in records:
            chunks.append(
                eval_audio_chunks(
                    record, sample_rate=frontend_cfg.sample_rate, clip_samples=n, policy=data_cfg.eval_crop
                )
            )
            bar.update()
    return chunks


def prepare_eval_set(
    records: Sequence[ClipRecord],
    *,
    data_cfg: DataConfig,
    frontend_cfg: FrontendConfig,
    progress: bool = False,
) -> EvalSet:
    """Decode a split once so that periodic validation only re-embeds it."""
    languages = tuple(data_cfg.languages)
    return EvalSet(
        chunks=load_clip_chunks(records, data_cfg=data_cfg, frontend_cfg=frontend_cfg, progress=progress),
        captions=eval_captions(records, languages),
        languages=languages,
    )


def embed_texts(
    model: Any,
    tokenizer: TextTokenizer,
    texts: Sequence[str],
    *,
    batch_size: int,
    device: torch.device,
    progress: bool = False,
) -> torch.Tensor:
    """(Q, d) float32 CPU text embeddings, in eval mode without gradients."""
    out = []
    with eval_mode(model), progress_bar(len(texts), "embedding captions", enabled=progress) as bar:
        for start in range(0, len(texts), batch_size):
            ids, mask = tokenizer.encode(list(texts[start : start + batch_size]))
            emb = model.encode_text(
                torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)
            )
            out.append(emb.float().cpu())
            bar.update(len(ids))
    return torch.cat(out) if out else torch.zeros(0, model.embed_dim)


def embed_chunks(
    model: Any,
    chunks: Sequence[np.ndarray],
    *,
    batch_size: int,
    device: torch.device,
    progress: bool = False,
) -> torch.Tensor:
    """(N, d) clip embeddings: the L2-normalized mean of each clip's chunk embeddings."""
    flat = np.concatenate(chunks, axis=0) if chunks else np.zeros((0, 1), np.float32)
    owner = torch.repeat_interleave(
        torch.arange(len(chunks)), torch.tensor([len(c) for c in chunks])
    )
    parts = []
    with eval_mode(model), progress_bar(len(flat), "embedding clips", enabled=progress) as bar:
        for start in range(0, len(flat), batch_size):
            wave = torch.from_numpy(np.ascontiguousarray(flat[start : start + batch_size])).to(
                device
            )
            parts.append(model.encode_audio(wave).float().cpu())
            bar.update(len(wave))
    if not parts:
        return torch.zeros(0, model.embed_dim)
    emb = torch.cat(parts)
    summed = torch.zeros(len(chunks), emb.shape[1]).index_add_(0, owner, emb)
    return F.normalize(summed, dim=-1)


def evaluate_prepared(
    model: Any,
    tokenizer: TextTokenizer,
    eval_set: EvalSet,
    *,
    batch_size: int,
    device: torch.device,
    progress: bool = False,
) -> dict[str, float]:
    """SPEC §5 report of `model` on an already decoded split (`progress`: bars on stderr)."""
    from index.metrics import retrieval_report

    captions = eval_set.captions
    audio = embed_chunks(model, eval_set.chunks, batch_size=batch_size, device=device, progress=progress)
    text = embed_texts(
        model, tokenizer, captions.texts, batch_size=batch_size, device=device, progress=progress
    )
    report = retrieval_report(
        audio_emb=audio.numpy(),
        text_emb=text.numpy(),
        caption_clip=np.asarray(captions.clip),
        caption_lang=np.asarray(captions.lang),
        caption_group=np.asarray(captions.group),
        languages=list(eval_set.languages),
    )
    return {key: float(value) for key, value in report.items()}


def report_keys(languages: Sequence[str]) -> list[str]:
    """Names of the metrics a report over `languages` can contain (for `eval.select_metric`)."""
    from index.languages import ENGLISH
    from index.metrics import DIRECTIONS, RETRIEVAL_METRICS

    keys = [
        f"{direction}_{metric}_{group}"
        for direction in DIRECTIONS
        for metric in RETRIEVAL_METRICS
        for group in (*languages, "mean")
    ]
    keys += [f"{name}_{direction}" for name in ("mrv", "mean_rank_std") for direction in DIRECTIONS]
    keys += [f"{name}_{lang}" for lang in languages if lang != ENGLISH for name in ("gap", "dis")]
    return keys


def evaluate_model(
    model: Any,
    tokenizer: TextTokenizer,
    records: Sequence[ClipRecord],
    *,
    data_cfg: DataConfig,
    frontend_cfg: FrontendConfig,
    batch_size: int,
    device: torch.device | str,
    progress: bool = False,
) -> dict[str, float]:
    """Retrieval report (recall, mAP@10, MRV, Gap/Dis per language) of `model` on `records`."""
    if not records:
        raise DataError("nothing to evaluate: the split has no clips")
    eval_set = prepare_eval_set(records, data_cfg=data_cfg, frontend_cfg=frontend_cfg, progress=progress)
    return evaluate_prepared(
        model, tokenizer, eval_set, batch_size=batch_size, device=torch.device(device), progress=progress
    )


# --- CLI ---------------------------------------------------------------------------------


def load_split(
    manifest: Path, *, data_cfg: DataConfig, split: str, eval_split: str = "val"
) -> list[ClipRecord]:
    """Records of one split, with clear errors for a missing file or an empty split.

    With the run's ``data.val_fraction``, `eval_split` is the share carved from
    ``train`` during training (and ``train`` the rest), as in the run.
    """
    from training.data.manifest import load_manifest
    from training.data.splits import TRAIN_SPLIT, carves, select_split

    carved = carves(split, data_cfg=data_cfg, eval_split=eval_split)
    records = load_manifest(
        manifest,
        languages=data_cfg.languages,
        skip_missing_audio=data_cfg.skip_missing_audio,
        split=TRAIN_SPLIT if carved else split,
        drop_other_languages=data_cfg.drop_other_languages,
    )
    if carved:
        records = select_split(records, split, data_cfg=data_cfg, eval_split=eval_split)
    if not records:
        raise DataError(f"{manifest}: no clips in split {split!r}")
    return records[: data_cfg.max_clips] if data_cfg.max_clips else records


def write_report(
    report: dict[str, float], *, languages: Sequence[str], out_dir: Path, meta: dict[str, Any]
) -> None:
    """`report.json` (metrics + provenance), `report.md` and `languages.png` in `out_dir`."""
    from index.report import METRIC_CONVENTION, format_report_markdown
    from training.plots import plot_language_report

    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {
        **meta,
        "languages": list(languages),
        "convention": METRIC_CONVENTION,
        "metrics": report,
    }
    (out_dir / "report.json").write_text(
        json.dumps(_finite_or_none(payload), indent=2) + "\n", encoding="utf-8"
    )
    (out_dir / "report.md").write_text(
        format_report_markdown(report, list(languages)), encoding="utf-8"
    )
    plot_language_report(report, languages, out_dir / "languages.png")


def _finite_or_none(value: Any) -> Any:
    """JSON has no NaN: undefined metrics (e.g. a language without captions) become null."""
    if isinstance(value, dict):
        return {k: _finite_or_none(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def cli_evaluate(args: argparse.Namespace) -> int:
    """`tonearm evaluate CHECKPOINT --data MANIFEST --split SPLIT [--out DIR]`."""
    from rich.console import Console

    from index.report import format_report_rich
    from training.checkpoint import load_checkpoint
    from training.runtime import resolve_device

    device = resolve_device("auto")
    checkpoint_dir = Path(args.checkpoint)
    checkpoint = load_checkpoint(checkpoint_dir, device=str(device))
    cfg = checkpoint.config
    records = load_split(Path(args.data), data_cfg=cfg.data, split=args.split, eval_split=cfg.eval.split)
    log.info("evaluating %s on %d %s clips", checkpoint_dir, len(records), args.split)
    report = evaluate_model(
        checkpoint.model,
        checkpoint.tokenizer,
        records,
        data_cfg=cfg.data,
        frontend_cfg=cfg.frontend,
        batch_size=cfg.eval.batch_size,
        device=device,
        progress=True,
    )
    out_dir = Path(args.out) if args.out else checkpoint_dir / f"eval-{args.split}"
    meta = {"checkpoint": str(checkpoint_dir), "manifest": str(args.data), "split": args.split}
    write_report(report, languages=cfg.data.languages, out_dir=out_dir, meta=meta)
    Console().print(format_report_rich(report, list(cfg.data.languages)))
    log.info("report written to %s", out_dir)
    return 0
