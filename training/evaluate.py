"""Embed a held-out split with a dual encoder and score it with the SPEC §5 metrics.

The evaluator only embeds and delegates: captions through the tokenizer and text
tower; audio through ``eval_audio_chunks`` (center crop or chunk-and-average, SPEC §2)
and the audio tower, chunk embeddings averaged and re-normalized per clip; the
numbers come from :func:`index.metrics.retrieval.retrieval_report`.

``tonearm evaluate CHECKPOINT --data MANIFEST --split test [--out DIR]`` writes
``report.json``, ``report.md`` and ``languages.png`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from index.bundle.tokenizer import TextTokenizer
from index.errors import AudioDecodeError, DataError
from training.config import DataConfig, FrontendConfig, short_clip_padding
from training.data.dataset import EvalCaptions, eval_audio_chunks, eval_captions
from training.data.manifest import ClipRecord
from training.runtime import eval_mode

log = logging.getLogger(__name__)


@dataclass
class EvalSet:
    """A split ready to embed: its clips (decoded window by window at each evaluation, never held
    in memory) and the caption queries."""

    records: list[ClipRecord]
    data_cfg: DataConfig
    frontend_cfg: FrontendConfig
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
                    record, sample_rate=frontend_cfg.sample_rate, clip_samples=n, policy=data_cfg.eval_crop,
                    padding=short_clip_padding(frontend_cfg),
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
    """The split's caption queries; its audio is streamed at each evaluation (:func:`embed_clips`),
    so a large validation split costs no memory between evaluations."""
    del progress  # nothing is decoded here any more
    languages = tuple(data_cfg.languages)
    return EvalSet(
        records=list(records),
        data_cfg=data_cfg,
        frontend_cfg=frontend_cfg,
        captions=eval_captions(records, languages),
        languages=languages,
    )


class ClipWindows(Dataset):
    """Item ``i``: ``(i, (C, n) evaluation windows of clip i, error or None)`` (loader workers decode).

    A clip that cannot be decoded gives no windows and its error message, so one bad file
    among a corpus costs one zero embedding and a warning, not the pass.
    """

    def __init__(self, records: Sequence[ClipRecord], *, data_cfg: DataConfig, frontend_cfg: FrontendConfig) -> None:
        self.records = list(records)
        self.sample_rate = frontend_cfg.sample_rate
        self.clip_samples = clip_samples(data_cfg, frontend_cfg)
        self.policy = data_cfg.eval_crop
        self.padding = short_clip_padding(frontend_cfg)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[int, np.ndarray, str | None]:
        try:
            windows = eval_audio_chunks(
                self.records[index], sample_rate=self.sample_rate, clip_samples=self.clip_samples,
                policy=self.policy, padding=self.padding,
            )
        except AudioDecodeError as err:
            return index, np.zeros((0, self.clip_samples), np.float32), str(err)
        return index, windows, None


def _keep_items(items: list[Any]) -> list[Any]:
    return items


@dataclass
class StreamStats:
    """What one streamed embedding pass did (logged; ``bench/extra_passes.py`` reports it)."""

    clips: int = 0
    windows: int = 0
    seconds: float = 0.0
    failed: list[str] = field(default_factory=list)

    def per_10k_clips_s(self) -> float:
        return self.seconds * 10_000 / max(1, self.clips)


def window_batches(windows: Sequence[int], budget: int) -> list[list[int]]:
    """Consecutive clip indices grouped so each group holds at most ``budget`` windows (at least one clip)."""
    batches: list[list[int]] = []
    current: list[int] = []
    held = 0
    for index, count in enumerate(windows):
        if current and held + count > budget:
            batches.append(current)
            current, held = [], 0
        current.append(index)
        held += count
    if current:
        batches.append(current)
    return batches


def file_windows(audio: Path, clip_seconds: float) -> int:
    """Chunk-and-average windows of a file (1 when its header cannot be read: it fails later, alone)."""
    import soundfile as sf

    try:
        info = sf.info(str(audio))
    except (RuntimeError, OSError):
        return 1
    return max(1, math.ceil(info.frames / max(1, info.samplerate) / clip_seconds))


def embed_clips(
    model: Any,
    records: Sequence[ClipRecord],
    *,
    data_cfg: DataConfig,
    frontend_cfg: FrontendConfig,
    batch_size: int,
    device: torch.device,
    num_workers: int = 0,
    progress: bool = False,
    description: str = "embedding clips",
    stats: StreamStats | None = None,
    windows: Sequence[int] | None = None,
) -> torch.Tensor:
    """(N, d) float32 CPU clip embeddings of ``records`` under ``data.eval_crop``, streamed.

    Clips are decoded ``batch_size`` at a time by ``num_workers`` loader workers (the center
    policy decodes only the middle window) and embedded as they arrive (:func:`embed_chunks`:
    chunk-and-average, re-normalised); only the embeddings are kept, so memory does not grow
    with the corpus' audio. Clips that fail to decode embed as zeros and are named in a warning.
    ``windows`` (each clip's window count, e.g. from the headers under chunk-and-average)
    groups clips so a batch holds about ``batch_size`` windows: a batch of 60-s clips then
    costs the memory of a batch of 5-s ones.
    """
    from torch.utils.data import DataLoader

    stats = stats if stats is not None else StreamStats()
    started = time.monotonic()
    dataset = ClipWindows(records, data_cfg=data_cfg, frontend_cfg=frontend_cfg)
    if windows is None:
        loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=_keep_items)
    else:
        loader = DataLoader(dataset, batch_sampler=window_batches(windows, batch_size), num_workers=num_workers,
                            collate_fn=_keep_items)
    out = torch.zeros(len(records), int(model.embed_dim))
    with progress_bar(len(records), description, enabled=progress) as bar:
        for items in loader:
            good = [(index, windows) for index, windows, error in items if error is None]
            stats.failed += [error for _, _, error in items if error is not None]
            if good:
                rows = torch.tensor([index for index, _ in good])
                out[rows] = embed_chunks(model, [w for _, w in good], batch_size=batch_size, device=device)
                stats.windows += sum(len(w) for _, w in good)
            stats.clips += len(items)
            bar.update(len(items))
    stats.seconds += time.monotonic() - started
    if stats.failed:
        log.warning("%s: %d of %d clips could not be decoded and embed as zeros, e.g. %s",
                    description, len(stats.failed), len(records), "; ".join(stats.failed[:3]))
    return out


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


def stack_windows(chunks: Sequence[np.ndarray]) -> np.ndarray:
    """Every clip's windows as one (W, n) array. Windows of different lengths (a PE-Audio clip longer than
    the window is one window of its own length) are right-padded with NaN, the marker the ``hf_pe_audio``
    tower reads as "no audio here" (:mod:`index.audio.frontend`), so each runs at its own length."""
    if not chunks:
        return np.zeros((0, 1), np.float32)
    width = max(c.shape[1] for c in chunks)
    if all(c.shape[1] == width for c in chunks):
        return np.concatenate(chunks, axis=0)
    return np.concatenate([np.pad(c, ((0, 0), (0, width - c.shape[1])), constant_values=np.nan) for c in chunks])


def embed_chunks(
    model: Any,
    chunks: Sequence[np.ndarray],
    *,
    batch_size: int,
    device: torch.device,
    progress: bool = False,
) -> torch.Tensor:
    """(N, d) clip embeddings: the L2-normalized mean of each clip's chunk embeddings."""
    flat = stack_windows(chunks)
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
    num_workers: int = 0,
) -> dict[str, float]:
    """SPEC §5 report of `model` on a prepared split (`progress`: bars on stderr)."""
    from index.metrics.retrieval import retrieval_report

    captions = eval_set.captions
    audio = embed_clips(
        model, eval_set.records, data_cfg=eval_set.data_cfg, frontend_cfg=eval_set.frontend_cfg,
        batch_size=batch_size, device=device, num_workers=num_workers, progress=progress,
    )
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
    from index.metrics.retrieval import DIRECTIONS, RETRIEVAL_METRICS

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
    from index.metrics.report import METRIC_CONVENTION, format_report_markdown
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

    from index.metrics.report import format_report_rich
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
