"""`tonearm train-moments`: train the temporal moment head on a bundle's frozen window embeddings.

Features come from the bundle's own ONNX encoders and the windows of the sliding-window baseline
(:func:`index.moments.windows.embed_windows`, window = the bundle's clip, hop = the evaluator's), so
the head sees exactly what the index stores. Each (recording, language, caption) of the manifest's
moments (docs/corpus.md, "Moments") is one training example; the objective is built by the
registry (``moment_span``, training/objectives/moment_span.py). The head is exported to
``moment_head.onnx`` (checked against torch with onnxruntime at export) and ``moment_head.json``, added
to a new bundle (the input's files plus the head, :func:`index.bundle.format.publish_with_moment_head`);
:mod:`index.moments.head` runs it without torch, the service when the bundle it serves has one.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from index.audio.decode import decode_audio
from index.bundle.evalset import write_moment_set
from index.bundle.format import EVAL_DIR, encoder_digests, publish_with_moment_head, read_manifest
from index.languages import DEFAULT_LANGUAGES
from index.moments.evaluate import evaluate_moment_set, moment_queries, moment_set_from_records
from index.moments.head import HEAD_INFO, HEAD_ONNX, MomentHeadModel
from index.moments.windows import HOP_FRACTION, embed_windows
from index.runtime.loader import LoadedBundle
from training.data.manifest import load_manifest
from training.models.moment_head import MomentHead
from training.objectives.registry import build_moment_loss

log = logging.getLogger(__name__)


@dataclass
class MomentExample:
    spans: np.ndarray
    """(T, 2) seconds of the windows."""
    windows: np.ndarray
    """(T, d) L2-normalized window embeddings."""
    text: np.ndarray
    """(d,) L2-normalized caption embedding."""
    truth: list[tuple[float, float]]
    language: str
    recording: str


def bundle_examples(bundle: Any, records: Sequence[Any], languages: Sequence[str]) -> list[MomentExample]:
    """One example per (recording, language, caption text) of ``records``' moments."""
    window = int(bundle.clip_samples)
    hop = max(1, int(round(window * HOP_FRACTION)))
    out = []
    for record in records:
        asked = {k: v for k, v in moment_queries(record.moments).items() if k[0] in languages}
        if not asked:
            continue
        wave = decode_audio(record.audio, sample_rate=bundle.sample_rate)
        spans, vectors = embed_windows(wave, sample_rate=bundle.sample_rate, window_samples=window,
                                       hop_samples=hop, encode=bundle.encode_audio)
        if not len(spans):
            continue
        texts = np.asarray(bundle.encode_text([t for _, t in asked]), np.float32)
        for (lang, _), text, truth in zip(asked, texts, asked.values(), strict=True):
            out.append(MomentExample(spans, vectors, text, list(truth), lang, record.id))
    return out


def span_reach(head: MomentHead, hop_seconds: float) -> float:
    """Seconds of recording one window's output depends on: its window plus the convolutions' context on
    each side (kernel k: ±(k // 2) windows a layer; the default head: 5 s + 2 × 4 × 2.5 s = 25 s). Inside a
    moment longer than that, windows see at most one of its edges: where the other is cannot be learned."""
    context = sum(int(conv.kernel_size[0]) // 2 for conv in head.convs if isinstance(conv, torch.nn.Conv1d))
    return round(head.window_seconds + 2 * context * hop_seconds, 3)


def _batch(examples: Sequence[MomentExample], reach: float = float("inf")) -> dict[str, torch.Tensor]:
    """Padded tensors of ``examples``; ``regress`` marks the positives of moments no longer than ``reach``
    (:func:`span_reach`): the longer ones teach relevance only (their spans are the served curve rule's,
    :meth:`index.moments.head.MomentHeadModel.moments`)."""
    size, d = len(examples), examples[0].windows.shape[1]
    t_max = max(len(e.spans) for e in examples)
    windows = np.zeros((size, t_max, d), np.float32)
    centres = np.zeros((size, t_max), np.float32)
    targets = np.zeros((size, t_max, 2), np.float32)
    positive = np.zeros((size, t_max), bool)
    regress = np.zeros((size, t_max), bool)
    valid = np.zeros((size, t_max), bool)
    lengths = np.zeros(size, np.float32)
    for i, e in enumerate(examples):
        t = len(e.spans)
        windows[i, :t], valid[i, :t] = e.windows, True
        c = e.spans.mean(axis=1)
        centres[i, :t] = c
        lengths[i] = float(e.spans[-1, 1] - e.spans[0, 0])
        for s, end in e.truth:
            inside = (c >= s) & (c <= end) & ~positive[i, :t]
            positive[i, :t] |= inside
            regress[i, :t] |= inside & (end - s <= reach)
            targets[i, :t][inside] = (s, end)
    return {"windows": torch.from_numpy(windows), "text": torch.from_numpy(np.stack([e.text for e in examples])),
            "centres": torch.from_numpy(centres), "targets": torch.from_numpy(targets),
            "positive": torch.from_numpy(positive), "regress": torch.from_numpy(regress), "valid": torch.from_numpy(valid),
            "lengths": torch.from_numpy(lengths)}


def train_head(examples: Sequence[MomentExample], *, seed: int = 0, steps: int = 300, batch_size: int = 32,
               lr: float = 3e-3, hidden: int = 64, layers: int = 2,
               objective: dict[str, Any] | None = None) -> MomentHead:
    """Adam on random batches of ``examples``; deterministic for a seed (CPU). Every positive window trains the
    relevance; only those of moments within the head's reach (:func:`span_reach`) train the spans."""
    if not examples:
        raise ValueError("no moment examples to train on (does the manifest's split have moments?)")
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    window_seconds = float(examples[0].spans[0, 1] - examples[0].spans[0, 0])
    head = MomentHead(examples[0].windows.shape[1], hidden=hidden, layers=layers, window_seconds=window_seconds)
    spans = examples[0].spans
    reach = span_reach(head, float(spans[1, 0] - spans[0, 0]) if len(spans) > 1 else window_seconds)
    loss_fn = build_moment_loss(objective or {"name": "moment_span"})
    optimizer = torch.optim.AdamW(head.parameters(), lr=lr, weight_decay=1e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=steps, pct_start=0.1)
    for step in range(steps):
        picked = rng.choice(len(examples), min(batch_size, len(examples)), replace=False)
        b = _batch([examples[i] for i in picked], reach)
        logits, distances = head(b["windows"], b["text"])
        terms = loss_fn(logits, distances, b["centres"], b["targets"], b["positive"], b["valid"], b["lengths"],
                        regress=b["regress"])
        loss = sum(terms.values())
        optimizer.zero_grad()
        loss.backward()  # type: ignore[union-attr]
        optimizer.step()
        schedule.step()
        if step % 100 == 0 or step == steps - 1:
            log.info("moment head step %d/%d: %s", step + 1, steps,
                     " ".join(f"{k}={float(v.detach()):.4f}" for k, v in terms.items()))
    return head.eval()


def export_head(head: MomentHead, out_dir: Path, *, window_seconds: float, hop_seconds: float,
                extra: dict[str, Any] | None = None) -> Path:
    """Write ``moment_head.onnx`` + ``moment_head.json``; checks onnxruntime against torch (atol 1e-4)."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    d = head.project.in_features - 1
    windows, text = torch.randn(1, 17, d), torch.randn(1, d)
    torch.onnx.export(head, (windows, text), str(out_dir / HEAD_ONNX), input_names=["windows", "text"],
                      output_names=["logits", "distances"],
                      dynamic_axes={"windows": {1: "windows"}, "logits": {1: "windows"}, "distances": {1: "windows"}},
                      opset_version=17, dynamo=False)
    info = {"embed_dim": d, "window_seconds": window_seconds, "hop_seconds": hop_seconds,
            "hidden": head.project.out_features, "layers": len(head.convs), **(extra or {})}
    (out_dir / HEAD_INFO).write_text(json.dumps(info, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    check = MomentHeadModel.load(out_dir)
    for t in (1, 9, 40):
        w, q = torch.randn(1, t, d), torch.randn(1, d)
        with torch.no_grad():
            logits, distances = head(w, q)
        got = check.outputs(w[0].numpy(), q[0].numpy())
        if not (np.allclose(got[0], logits[0].numpy(), atol=1e-4) and np.allclose(got[1], distances[0].numpy(), atol=1e-4)):
            raise RuntimeError(f"{out_dir / HEAD_ONNX}: onnxruntime disagrees with torch for {t} windows")
    return out_dir / HEAD_ONNX


def longest_moment(examples: Sequence[MomentExample], reach: float = float("inf")) -> float:
    """The longest ground-truth moment among ``examples`` whose span the head learned (no longer than ``reach``,
    :func:`span_reach`; seconds): past it the served head's spans are not what it learned, and a long stretch of
    its relevance curve is the moment (:meth:`index.moments.head.MomentHeadModel.moments`). ``reach`` when none is
    that short."""
    lengths = [end - start for e in examples for start, end in e.truth]
    learned = [x for x in lengths if x <= reach]
    return round(max(learned) if learned else (reach if lengths else 0.0), 3)


def attach_moment_head(source: Path, train_records: Sequence[Any], out: Path, *, seed: int = 0, steps: int = 300,
                       heldout_records: Sequence[Any] = (), training: dict[str, Any] | None = None) -> Path:
    """Train a head on ``train_records``' moments with ``source``'s frozen encoders and publish ``out``: the source
    bundle plus the head. With ``heldout_records`` (recordings with moments it was not trained on) both scorers
    are measured on them, side by side (``moments.heldout`` and ``moment_head.heldout``), and the recordings
    with their queries are kept in ``eval/`` for the quality gate (:func:`index.bundle.evalset.write_moment_set`)."""
    source, out = Path(source), Path(out)
    bundle = LoadedBundle.open(source)
    try:
        languages = [lang for lang in DEFAULT_LANGUAGES if lang in bundle.languages]
        examples = bundle_examples(bundle, [r for r in train_records if r.moments], languages)
        digests = encoder_digests(bundle.manifest)
        source_id, rate = bundle.bundle_id, bundle.sample_rate
        log.info("moment head: %d examples from %d recordings", len(examples), len({e.recording for e in examples}))
        head = train_head(examples, seed=seed, steps=steps)
        window = float(examples[0].spans[0, 1] - examples[0].spans[0, 0])
        hop = float(examples[0].spans[1, 0] - examples[0].spans[0, 0]) if len(examples[0].spans) > 1 else window
        described = {**(training or {}), "seed": seed, "steps": steps, "examples": len(examples),
                     "span_reach_seconds": span_reach(head, hop),
                     "longest_moment_seconds": longest_moment(examples, span_reach(head, hop))}
        with tempfile.TemporaryDirectory(prefix="moment-head-") as folder:
            export_head(head, Path(folder), window_seconds=window, hop_seconds=hop,
                        extra={"bundle": source_id, "encoder_sha256": digests, **described})
            moment_set = moment_set_from_records([r for r in heldout_records if r.moments], sample_rate=rate,
                                                 languages=languages)
            reports = None
            if moment_set.queries:
                reports = evaluate_moment_set(bundle, moment_set, languages=languages,
                                              head=MomentHeadModel.load(Path(folder)))
                write_moment_set(Path(folder) / EVAL_DIR, moment_set)
                described["heldout_recordings"] = len(moment_set.recording_ids)
                log.info("moment head held out on %d recordings (%d queries): R1@0.7 windows %.3f, head %.3f",
                         len(moment_set.recording_ids), len(moment_set.queries),
                         reports["windows"]["moment_R1@0.7_mean"], reports["head"]["moment_R1@0.7_mean"])
            path = publish_with_moment_head(source, Path(folder), out.parent, out.name, training=described,
                                            heldout=reports)
    finally:
        bundle.close()
    log.info("wrote bundle %s: %s plus its moment head", path, source_id)
    return path


def cli_train_moments(args: argparse.Namespace) -> int:
    """``tonearm train-moments --bundle DIR --manifest M [--out NEW_BUNDLE] [--split train] [--heldout-split test]
    [--seed N] [--steps N]``.

    Writes a new bundle (``--out``, default ``<bundle>-head-s<seed>`` beside the input): the input bundle's
    files (hard links, else copies; the input is not touched) plus the head, recorded in its manifest's
    ``moment_head`` with the sha256 of the encoders it was trained on (docs/bundle.md, "Moment head"); both
    scorers' report on ``--heldout-split`` (``none``: skipped) in ``moments.heldout`` and ``moment_head.heldout``."""
    source = Path(args.bundle)
    manifest = Path(args.manifest)
    records = load_manifest(manifest, languages=DEFAULT_LANGUAGES, split=args.split)
    heldout_split = getattr(args, "heldout_split", "none")
    heldout = [] if heldout_split == "none" else load_manifest(manifest, languages=DEFAULT_LANGUAGES,
                                                                split=heldout_split)
    out = Path(args.out) if args.out else source.parent / f"{read_manifest(source).bundle_id}-head-s{args.seed}"
    training = {"data_manifest": str(manifest.resolve()), "split": args.split, "heldout_split": heldout_split}
    attach_moment_head(source, records, out, seed=args.seed, steps=args.steps, heldout_records=heldout,
                       training=training)
    return 0
