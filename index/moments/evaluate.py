"""`tonearm evaluate BUNDLE --moments`: the sliding-window baseline measured as the papers measure it.

For every clip of the manifest's split that has ``moments`` (docs/corpus.md, "Moments"), each
distinct (language, caption text) among its moments is a query whose ground truth is every moment
of that recording carrying that text. The bundle's audio encoder embeds the recording's windows
(the bundle's window and hop, :mod:`index.moments.windows`), its text encoder the caption; the window
scores become ranked moments (:func:`index.moments.postprocess.moments_from_scores`) and
:func:`index.metrics.moments.moment_report` scores them: Recall1@0.5, Recall1@0.7 and
mAP@[0.5:0.95] per language. As in Munakata et al. (2024) and CASTELLA, a query is asked of its
own recording (moment retrieval, not the choice of the recording).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
import soxr

from index.audio.decode import decode_audio
from index.bundle.evalset import MomentQuerySpec, MomentSet
from index.errors import DataError
from index.metrics.moments import MOMENT_METRICS, MomentQuery, moment_report
from index.moments.head import MomentHeadModel
from index.moments.postprocess import MomentParams, moments_from_scores
from index.moments.windows import HOP_FRACTION, embed_windows

log = logging.getLogger(__name__)


def moment_queries(moments: Sequence[Any]) -> dict[tuple[str, str], list[tuple[float, float]]]:
    """``{(language, caption text): [spans]}`` of one recording's moments (the evaluation's queries)."""
    queries: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for moment in moments:
        for lang, texts in moment.captions.items():
            for text in texts:
                spans = queries.setdefault((lang, text), [])
                if (moment.start, moment.end) not in spans:
                    spans.append((moment.start, moment.end))
    return queries


def evaluate_moments(
    bundle: Any, records: Sequence[Any], *, languages: Sequence[str], params: MomentParams | None = None
) -> dict[str, float]:
    """The sliding-window moment report of ``bundle`` (a :class:`index.runtime.loader.LoadedBundle`) on ``records``."""
    return evaluate_moment_scorers(bundle, records, languages=languages, params=params)["windows"]


def evaluate_moment_scorers(
    bundle: Any, records: Sequence[Any], *, languages: Sequence[str], params: MomentParams | None = None,
    head: MomentHeadModel | None = None,
) -> dict[str, dict[str, float]]:
    """``{"windows": report}``, plus ``"head": report`` with ``head`` (the bundle's trained moment head): both
    scorers on the same queries and the same window embeddings, encoded once."""
    def asked(record: Any) -> dict[tuple[str, str], list[tuple[float, float]]]:
        return {key: spans for key, spans in moment_queries(record.moments).items() if key[0] in languages}

    recordings = ((lambda r=record: decode_audio(r.audio, sample_rate=bundle.sample_rate), asked(record))
                  for record in records)
    return _score_recordings(bundle, recordings, languages=languages, params=params, head=head)


def moment_set_from_records(records: Sequence[Any], *, sample_rate: int, languages: Sequence[str]) -> MomentSet:
    """The held-out moment set a bundle keeps (``eval/moment_*``, :mod:`index.bundle.evalset`): each record with
    moments decoded at ``sample_rate``, each of its (language, caption) a query with its spans."""
    ids: list[str] = []
    waves: list[np.ndarray] = []
    queries: list[MomentQuerySpec] = []
    for record in records:
        asked = {key: spans for key, spans in moment_queries(record.moments).items() if key[0] in languages}
        if not asked:
            continue
        for (lang, text), spans in asked.items():
            queries.append(MomentQuerySpec(len(ids), lang, text, list(spans)))
        ids.append(str(record.id))
        waves.append(decode_audio(record.audio, sample_rate=sample_rate))
    return MomentSet(ids, waves, queries, sample_rate)


def evaluate_moment_set(
    bundle: Any, moment_set: MomentSet, *, languages: Sequence[str], params: MomentParams | None = None,
    head: MomentHeadModel | None = None,
) -> dict[str, dict[str, float]]:
    """:func:`evaluate_moment_scorers` on a stored moment set (resampled to ``bundle``'s rate when it differs):
    what the quality gate asks each bundle (docs/service.md, "Quality gate")."""
    rate = int(bundle.sample_rate)

    def wave(row: int) -> np.ndarray:
        found = moment_set.waveforms[row]
        if not moment_set.sample_rate or moment_set.sample_rate == rate:
            return found
        return soxr.resample(found, moment_set.sample_rate, rate, quality="HQ").astype(np.float32)

    by_row: dict[int, dict[tuple[str, str], list[tuple[float, float]]]] = {}
    for q in moment_set.queries:
        if q.lang in languages:
            by_row.setdefault(q.recording, {})[(q.lang, q.text)] = list(q.spans)
    recordings = ((lambda r=row: wave(r), asked) for row, asked in sorted(by_row.items()))
    return _score_recordings(bundle, recordings, languages=languages, params=params, head=head)


def _score_recordings(
    bundle: Any, recordings: Iterable[tuple[Callable[[], np.ndarray], dict[tuple[str, str], list[tuple[float, float]]]]],
    *, languages: Sequence[str], params: MomentParams | None, head: MomentHeadModel | None,
) -> dict[str, dict[str, float]]:
    """Each (lazily decoded recording, its queries): windows embedded once, scored by the windows and the head."""
    window = int(bundle.clip_samples)
    hop = max(1, int(round(window * HOP_FRACTION)))
    queries: dict[str, list[MomentQuery]] = {"windows": [], **({"head": []} if head is not None else {})}
    for load, asked in recordings:
        if not asked:
            continue
        wave = load()
        spans, vectors = embed_windows(wave, sample_rate=bundle.sample_rate, window_samples=window, hop_samples=hop,
                                       encode=bundle.encode_audio)
        if not len(spans):  # a recording no longer than one window: the whole of it is the only moment
            spans, vectors = np.array([[0.0, len(wave) / bundle.sample_rate]]), bundle.encode_audio([wave])
        keys = list(asked)
        texts = np.asarray(bundle.encode_text([text for _, text in keys]), dtype=np.float32)
        scores = texts @ np.asarray(vectors, dtype=np.float32).T
        for (lang, _), text, row, truth in zip(keys, texts, scores, asked.values(), strict=True):
            found = moments_from_scores(spans, row, params)
            queries["windows"].append(MomentQuery(lang, truth, [(m.start, m.end, m.score) for m in found]))
            if head is not None:
                placed = head.moments(spans, vectors, text)
                queries["head"].append(MomentQuery(lang, truth, [(m.start, m.end, m.score) for m in placed]))
    if not queries["windows"]:
        raise DataError("no clip of the evaluated split has moments in the requested languages "
                        "(docs/corpus.md, 'Moments')")
    return {scorer: moment_report(asked, languages) for scorer, asked in queries.items()}


def format_moment_report(report: dict[str, float], languages: Sequence[str]) -> str:
    """A Markdown table: one row per language (and the mean), metrics in %."""
    head = "| language | queries | " + " | ".join(MOMENT_METRICS) + " |"
    lines = [head, "|" + "---|" * (len(MOMENT_METRICS) + 2)]
    for lang in [*languages, "mean"]:
        if f"moment_R1@0.5_{lang}" not in report:
            continue
        count = "" if lang == "mean" else str(int(report[f"moment_n_queries_{lang}"]))
        cells = " | ".join(f"{100 * report[f'moment_{m}_{lang}']:.1f}" for m in MOMENT_METRICS)
        lines.append(f"| {lang} | {count} | {cells} |")
    return "\n".join(lines) + "\n\nmAP is mAP@[0.5:0.95] (docs/metrics.md, 'Moments'); sliding-window baseline.\n"



def format_moment_comparison(reports: dict[str, dict[str, float]], languages: Sequence[str]) -> str:
    """Both scorers side by side: one row per language (and the mean), each metric as windows → head, in %."""
    base, head = reports["windows"], reports["head"]
    cells = [f"{m} windows | {m} head" for m in MOMENT_METRICS]
    lines = ["| language | queries | " + " | ".join(cells) + " |", "|" + "---|" * (2 * len(MOMENT_METRICS) + 2)]
    for lang in [*languages, "mean"]:
        if f"moment_R1@0.5_{lang}" not in base:
            continue
        count = "" if lang == "mean" else str(int(base[f"moment_n_queries_{lang}"]))
        values = " | ".join(f"{100 * base[f'moment_{m}_{lang}']:.1f} | {100 * head[f'moment_{m}_{lang}']:.1f}"
                            for m in MOMENT_METRICS)
        lines.append(f"| {lang} | {count} | {values} |")
    return ("\n".join(lines) + "\n\nmAP is mAP@[0.5:0.95] (docs/metrics.md, 'Moments'); *windows*: the sliding-window "
            "scorer, *head*: the bundle's trained moment head, on the same queries and window embeddings.\n")
