"""Benchmark: training-step time and peak memory of each objective config vs InfoNCE.

One step = forward + backward of the real built-in towers (from ``--config``, default
configs/default.yaml) + the objective, on identical synthetic batches (waveforms of
``data.clip_seconds``, token ids with caption-like lengths of 8–24 tokens); a strategy
with V text views encodes the first V of the same 8 caption sets. Entries are timed
round-robin (``--repeats`` rounds after one warm-up round) and the median is reported,
so a neighbour's load drifts over all entries alike; ratios use process CPU time, and
one thread (``OMP_NUM_THREADS=1``) keeps it free of OpenMP spin-waits. Peak memory is the maximum of the
torch CPU profiler's memory timeline (``profile_memory=True``; every live tensor,
including parameters and gradients) over one profiled step per entry.

    OMP_NUM_THREADS=1 python bench/objective_overhead.py --repeats 7   # table + docs/BENCHMARKS.md
    OMP_NUM_THREADS=1 python bench/objective_overhead.py --only 'KCL (8 languages)' --no-write

Adding rows: append a dict to ``ENTRIES`` — ``name``, ``objective`` (an
``ObjectiveConfig`` dict), optional ``target`` (max time ratio vs InfoNCE), optional
``teachers`` (``{"count": M, "cached": bool}``: cached = precomputed teacher embeddings,
uncached = M frozen towers run every step), optional ``prepare(objective, setup)``
(called once before timing, e.g. to build a knowledge base through
``objective.on_epoch_start``) and optional ``extras(objective, setup) -> dict[label,
seconds]`` for one-off costs printed as separate lines (e.g. ASK's KB rebuild time).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from training.config import ObjectiveConfig, TrainConfig, load_train_config  # noqa: E402
from training.models.dual_encoder import DualEncoder, build_dual_encoder  # noqa: E402
from training.objectives.base import BuildEnv, EmbeddingBatch, Objective, total_loss  # noqa: E402
from training.objectives.registry import build_objective  # noqa: E402

from benchlib import cpu_model, publish_section  # noqa: E402

START = "<!-- bench:objective_overhead:start -->"
END = "<!-- bench:objective_overhead:end -->"
MAX_VIEWS = 8

SVR_DYNAMIC = {"name": "svr", "radius": "dynamic", "direction": "bi"}

class _SyntheticKnowledgeSource:
    """TrainingContext stand-in for ASK's knowledge-base build: random unit embeddings the size of the
    small corpus's training set (2400 clips x 5 captions x 8 languages = 96k pairs)."""

    epoch = 0
    step = 0
    device = torch.device("cpu")

    def __init__(self, env: BuildEnv, *, clips: int = 2400, captions: int = 40, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.audio = F.normalize(torch.randn(clips, env.embed_dim, generator=gen), dim=-1)
        self.clip = torch.arange(clips).repeat_interleave(captions)
        noise = torch.randn(self.clip.numel(), env.embed_dim, generator=gen)
        self.text = F.normalize(self.audio[self.clip] + 0.5 * noise, dim=-1)

    def embed_training_pairs(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.audio[self.clip], self.text, self.clip

    def embed_clips(self, clip_index: Tensor) -> Tensor:
        return self.audio[clip_index]


def _ask_build(objective: Objective, setup: Setup) -> None:
    objective.on_epoch_start(_SyntheticKnowledgeSource(setup.env))  # type: ignore[arg-type]


def _ask_rebuild_seconds(objective: Objective, setup: Setup) -> dict[str, float]:
    source = _SyntheticKnowledgeSource(setup.env, seed=1)
    started = time.perf_counter()
    objective.base.rebuild(source)  # type: ignore[operator]
    label = "ASK knowledge-base rebuild from 96k pairs (FAISS indices + K-Means 512; excludes embedding the pairs)"
    return {label: time.perf_counter() - started}


ENTRIES: list[dict[str, Any]] = [
    {"name": "infonce", "objective": {}},  # the reference: keep first
    {"name": "siglip", "objective": {"base": {"name": "siglip"}}},
    {"name": "infonce + bi-static SVR", "objective": {"regularizers": [{"name": "svr", "radius": "static"}]},
     "target": 1.03},
    {"name": "infonce + bi-dynamic SVR", "objective": {"regularizers": [SVR_DYNAMIC]}, "target": 1.03},
    {"name": "CACL", "objective": {"strategy": {"name": "cacl"}}, "target": 1.15},
    {"name": "KCL (8 languages)", "objective": {"strategy": {"name": "kcl"}}, "target": 1.3},
    {"name": "siglip + CACL + bi-dynamic SVR",
     "objective": {"base": {"name": "siglip"}, "strategy": {"name": "cacl"}, "regularizers": [SVR_DYNAMIC]}},
    {"name": "distill M=3, cached teachers",
     "objective": {"distill": {"teachers": ["t1", "t2", "t3"]}}, "teachers": {"count": 3, "cached": True}},
    {"name": "distill M=1, teachers run every step",
     "objective": {"distill": {"teachers": ["t1"], "cache": "off"}}, "teachers": {"count": 1, "cached": False}},
    {"name": "DART (IOT + UWD with RAM)", "objective": {"base": {"name": "iot"}, "regularizers": [{"name": "uwd"}]},
     "target": 1.10},
    {"name": "DART w/o RAM (uniform marginals)",
     "objective": {"base": {"name": "iot"}, "regularizers": [{"name": "uwd", "marginals": "uniform"}]}, "target": 1.10},
    {"name": "ASK (fine + coarse KB of 96k pairs)", "objective": {"knowledge": {}}, "target": 1.5,
     "prepare": _ask_build, "extras": _ask_rebuild_seconds},
]


@dataclass
class Setup:
    """What every entry shares: the towers and one fixed synthetic batch."""

    config: TrainConfig
    model: DualEncoder
    waveform: Tensor
    input_ids: Tensor
    attention_mask: Tensor
    env: BuildEnv


def make_setup(config: TrainConfig, *, batch_size: int, seed: int) -> Setup:
    torch.manual_seed(seed)
    vocab = config.model.text.vocab_size
    model = build_dual_encoder(config.model, config.frontend, vocab_size=vocab).train()
    samples = int(round(config.data.clip_seconds * config.frontend.sample_rate))
    waveform = 0.1 * torch.randn(batch_size, samples)
    length = config.model.text.max_length
    ids = torch.randint(3, vocab, (MAX_VIEWS, batch_size, length))
    lengths = torch.randint(8, min(24, length) + 1, (MAX_VIEWS, batch_size, 1))
    mask = (torch.arange(length) < lengths).long()
    env = BuildEnv(languages=tuple(config.data.languages), embed_dim=config.model.embed_dim)
    return Setup(config, model, waveform, ids * mask, mask, env)


class Entry:
    """One benchmark row: its objective, and its teachers when it distils."""

    def __init__(self, spec: dict[str, Any], setup: Setup) -> None:
        self.spec = spec
        self.name: str = spec["name"]
        self.objective: Objective = build_objective(ObjectiveConfig(**spec["objective"]), setup.env)
        self.views = self.objective.strategy.num_views
        self.teacher_models: list[DualEncoder] = []
        self.cached: tuple[Tensor, Tensor] | None = None
        teachers = spec.get("teachers")
        if teachers and teachers["cached"]:
            shape = (teachers["count"], setup.waveform.shape[0], setup.env.embed_dim)
            self.cached = (
                F.normalize(torch.randn(*shape), dim=-1),
                F.normalize(torch.randn(shape[0], self.views, *shape[1:]), dim=-1),
            )
        elif teachers:
            cfg = setup.config
            for _ in range(teachers["count"]):
                teacher = build_dual_encoder(cfg.model, cfg.frontend, vocab_size=cfg.model.text.vocab_size).eval()
                self.teacher_models.append(teacher.requires_grad_(False))
        if "prepare" in spec:
            spec["prepare"](self.objective, setup)

    def teacher_embeddings(self, setup: Setup, ids: Tensor, mask: Tensor) -> tuple[Tensor | None, Tensor | None]:
        if self.cached is not None:
            return self.cached
        if not self.teacher_models:
            return None, None
        with torch.no_grad():
            audio = torch.stack([t.encode_audio(setup.waveform) for t in self.teacher_models])
            text = torch.stack([t.encode_text(ids, mask) for t in self.teacher_models])
        return audio, text.view(len(self.teacher_models), self.views, setup.waveform.shape[0], -1)

    def step(self, setup: Setup) -> None:
        """Forward + backward of towers and objective (gradients discarded)."""
        setup.model.zero_grad(set_to_none=True)
        self.objective.zero_grad(set_to_none=True)
        batch_size = setup.waveform.shape[0]
        ids = setup.input_ids[: self.views].reshape(self.views * batch_size, -1)
        mask = setup.attention_mask[: self.views].reshape(self.views * batch_size, -1)
        teacher_audio, teacher_text = self.teacher_embeddings(setup, ids, mask)
        audio = setup.model.encode_audio(setup.waveform)
        text = setup.model.encode_text(ids, mask).view(self.views, batch_size, -1)
        batch = EmbeddingBatch(
            audio=audio, text=text, text_mask=torch.ones(self.views, batch_size, dtype=torch.bool),
            clip_index=torch.arange(batch_size), teacher_audio=teacher_audio, teacher_text=teacher_text,
        )
        total_loss(self.objective(batch)).backward()

    def objective_ms(self, setup: Setup, *, repeats: int = 20) -> float:
        """Median CPU milliseconds of the objective alone (forward + backward) on fixed leaf embeddings."""
        g = torch.Generator().manual_seed(0)
        size, dim = setup.waveform.shape[0], setup.env.embed_dim

        def unit(*shape: int) -> Tensor:
            return F.normalize(torch.randn(*shape, size, dim, generator=g), dim=-1)

        count = self.spec["teachers"]["count"] if self.spec.get("teachers") else 0
        batch = EmbeddingBatch(
            audio=unit().requires_grad_(True), text=unit(self.views).requires_grad_(True),
            text_mask=torch.ones(self.views, size, dtype=torch.bool), clip_index=torch.arange(size),
            teacher_audio=unit(count) if count else None, teacher_text=unit(count, self.views) if count else None,
        )
        samples = []
        for _ in range(repeats + 1):
            started = time.process_time()
            total_loss(self.objective(batch)).backward()
            samples.append(time.process_time() - started)
        return 1000 * statistics.median(samples[1:])


def peak_memory_mb(entry: Entry, setup: Setup) -> float:
    """Peak of the torch CPU profiler's memory timeline over one step, in MB."""
    from torch.profiler import ProfilerActivity, profile

    setup.model.zero_grad(set_to_none=True)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True, record_shapes=True, with_stack=True) as prof:
        entry.step(setup)
    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        path = Path(tmp) / "timeline.json"
        prof.export_memory_timeline(str(path), device="cpu")
        _, sizes = json.loads(path.read_text())
    return max(sum(row) for row in sizes) / 1e6


def time_entries(entries: list[Entry], setup: Setup, *, repeats: int) -> dict[str, tuple[float, float]]:
    """(median wall seconds, median process CPU seconds) of a step per entry, round-robin after a warm-up round.

    CPU time (all threads of this process) is what the ratios use: on a machine shared
    with other jobs it moves far less with their load than wall time does.
    """
    samples: dict[str, list[tuple[float, float]]] = {e.name: [] for e in entries}
    for round_ in range(repeats + 1):
        for entry in entries:
            wall, cpu = time.perf_counter(), time.process_time()
            entry.step(setup)
            if round_ > 0:
                samples[entry.name].append((time.perf_counter() - wall, time.process_time() - cpu))
        print(f"  round {round_}/{repeats} done", file=sys.stderr)
    return {
        name: (statistics.median(v[0] for v in values), statistics.median(v[1] for v in values))
        for name, values in samples.items()
    }


def markdown(rows: list[dict[str, Any]], extras: list[tuple[str, float]], *, command: str, setup: Setup) -> str:
    cfg = setup.config
    lines = [
        START,
        "## objective_overhead — training-step time and peak memory vs InfoNCE",
        "",
        f"- command: `{command}`",
        f"- machine: {cpu_model()}, {os.cpu_count()} cores, OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"torch {torch.__version__}, Python {platform.python_version()}",
        f"- date: {dt.date.today().isoformat()}",
        f"- batch {setup.waveform.shape[0]} clips of {cfg.data.clip_seconds:g} s, built-in towers "
        f"({cfg.model.audio.kind} audio, {cfg.model.text.kind} text, d={cfg.model.embed_dim}), "
        f"{len(cfg.data.languages)} languages; step = forward + backward of towers + objective, median "
        "of round-robin repeats; time ratios use the process CPU time (robust to other jobs on a shared "
        "machine; wall time shown for reference); memory = peak of the torch CPU profiler's memory "
        "timeline (live tensors: parameters, gradients, activations); objective alone = CPU time of "
        "the objective's forward + backward on fixed embeddings (what the objective itself adds).",
        "",
        "| objective | text views | wall (s) | CPU (s) | × InfoNCE | target | objective alone (ms) "
        "| peak memory (MB) | × InfoNCE |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        target = f"≤ {row['target']:.2f}×" if row.get("target") else ""
        lines.append(
            f"| {row['name']} | {row['views']} | {row['wall']:.2f} | {row['cpu']:.2f} | {row['time_ratio']:.3f} | {target} "
            f"| {row['objective_ms']:.1f} | {row['memory']:.0f} | {row['memory_ratio']:.3f} |"
        )
    for label, seconds in extras:
        lines.append(f"\n- {label}: {seconds:.2f} s")
    lines.append(END)
    return "\n".join(lines) + "\n"






def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "default.yaml"))
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", help="entry name (repeatable); InfoNCE is always included")
    parser.add_argument("--no-write", action="store_true", help="print only; do not update docs/BENCHMARKS.md")
    args = parser.parse_args(argv)

    config = load_train_config(args.config) if Path(args.config).is_file() else TrainConfig()
    setup = make_setup(config, batch_size=args.batch_size, seed=args.seed)
    specs = [s for i, s in enumerate(ENTRIES) if i == 0 or not args.only or s["name"] in args.only]
    entries = [Entry(spec, setup) for spec in specs]
    seconds = time_entries(entries, setup, repeats=args.repeats)
    memory = {e.name: peak_memory_mb(e, setup) for e in entries}
    objective_ms = {e.name: e.objective_ms(setup) for e in entries}
    reference = entries[0].name
    rows = [
        {
            "name": e.name, "views": e.views, "wall": seconds[e.name][0], "cpu": seconds[e.name][1],
            "target": e.spec.get("target"), "time_ratio": seconds[e.name][1] / seconds[reference][1],
            "objective_ms": objective_ms[e.name], "memory": memory[e.name],
            "memory_ratio": memory[e.name] / memory[reference],
        }
        for e in entries
    ]
    extras: list[tuple[str, float]] = []
    for entry in entries:
        if "extras" in entry.spec:
            extras.extend(entry.spec["extras"](entry.objective, setup).items())
    threads = os.environ.get("OMP_NUM_THREADS")
    prefix = f"OMP_NUM_THREADS={threads} " if threads else ""
    command = prefix + "python bench/objective_overhead.py " + " ".join(argv or sys.argv[1:])
    section = markdown(rows, extras, command=command.strip(), setup=setup)
    publish_section(section, start=START, end=END, write=not args.no_write)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
