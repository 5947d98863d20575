"""ASK's partitioned knowledge bases (training/knowledge.py, issue 39 item 1) on 2 and 3 gloo processes.

Each rank holds an uneven share of the clips (and so of the KB rows). The merged top-K of the
fine KB must equal a brute-force numpy top-K over every row (self-exclusion included); the
coarse KB (K-Means once on rank 0, centroids broadcast, prototypes max-reduced) must equal the
single-process build; and the whole ASK objective — global rows, drift sample, loss — must give
the single-process numbers. Collectives run with the device check on (NCCL-correct tensors).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from tests.training.test_distributed_runs import free_port

DIM, CLIPS, K = 8, 23, 4
SPLITS = {2: [0, 9, 23], 3: [0, 5, 16, 23]}
"""Clip ranges per rank: uneven on purpose."""
QUERY_CLIPS = [0, 5, 9, 16, 22, 3]
SAMPLE_CAP = 4
"""K-Means points per centroid in these tests: 5 clusters × 4 < the pairs, so K-Means trains on a sample."""


def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(audio per pair, text per pair, clip per pair): 1–3 captions per clip, clip-major."""
    gen = torch.Generator().manual_seed(7)
    caps = torch.randint(1, 4, (CLIPS,), generator=gen)
    clip = torch.arange(CLIPS).repeat_interleave(caps)
    audio = F.normalize(torch.randn(CLIPS, DIM, generator=gen), dim=-1)
    text = F.normalize(audio[clip] + 0.5 * torch.randn(clip.numel(), DIM, generator=gen), dim=-1)
    return audio[clip], text, clip


def _queries() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    u = F.normalize(torch.randn(len(QUERY_CLIPS), DIM, generator=gen), dim=-1)
    v = F.normalize(torch.randn(len(QUERY_CLIPS), DIM, generator=gen), dim=-1)
    return u, v, torch.tensor(QUERY_CLIPS)


class _Context:
    """A TrainingContext over `_data()` moved by `version` (drift); `share` = this rank's clip range."""

    def __init__(self, share: range | None) -> None:
        self.epoch = self.step = self.version = 0
        self.device = torch.device("cpu")
        self.share = share

    def _pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        audio, text, clip = _data()
        if self.version:
            gen = torch.Generator().manual_seed(100 + self.version)
            audio = F.normalize(audio + 0.2 * torch.randn(CLIPS, DIM, generator=gen)[clip], dim=-1)
        return audio, text, clip

    def embed_training_pairs(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._pairs()

    def embed_training_pairs_local(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        audio, text, clip = self._pairs()
        assert self.share is not None
        mine = (clip >= self.share.start) & (clip < self.share.stop)
        return audio[mine], text[mine], clip[mine]


def _ask():  # noqa: ANN202
    from training.objectives.ask import wrap_with_knowledge
    from training.objectives.base import BuildEnv
    from training.objectives.infonce import InfoNCE, InfoNCEConfig

    env = BuildEnv(languages=("eng",), embed_dim=DIM)
    base = InfoNCE(InfoNCEConfig(tau=0.07, learnable_tau=False), env)
    return wrap_with_knowledge({"n_clusters": 5, "top_k": 3, "drift_sample": 6}, base, env).train()


def _ask_run(context: _Context) -> dict[str, object]:
    """Two builds (the second after the encoders moved) and the loss of a batch after each."""
    from training.objectives.base import AlignedPair

    term, (u, v, clip), losses = _ask(), _queries(), []
    for version in (0, 1):
        context.version = version
        term.rebuild(context)
        pair = AlignedPair(left=u, right=v, clip_index=clip, kind="audio-text", weight=1.0, name="t")
        losses.append(float(term(pair)["ask_loss"]))
    return {"loss": losses, "rdm": [entry["rdm"] for entry in term.drift_log]}


def _build(audio, text, clip, *, rows=None, partitioned=False):  # noqa: ANN001, ANN202
    from training.knowledge import build_coarse_kb, build_fine_kb

    fine = build_fine_kb(audio, text, clip, partitioned=partitioned)
    coarse = build_coarse_kb(audio, text, n_clusters=5, seed=3, iters=10, rows=rows, partitioned=partitioned)
    u, v, exclude = _queries()
    k = fine.effective_k(K, exclude=True)
    hood = fine.retrieve(u, v, k=k, exclude_clip=exclude)
    coarse_hood = coarse.retrieve(u, v, k=2)
    return {
        "k": k, "fine": [hood.audio, hood.audio_partner, hood.text, hood.text_partner],
        "coarse_protos": [coarse.audio.keys.clone(), coarse.text.keys.clone()],
        "coarse": [coarse_hood.audio, coarse_hood.text_partner],
        "totals": [fine.audio.total, fine.text.total, fine.audio.max_per_clip, fine.text.max_per_clip],
    }


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from training import distributed, knowledge

    knowledge.KMEANS_POINTS_PER_CENTROID = SAMPLE_CAP
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    distributed.init_process_group(torch.device("cpu"), timeout_s=60)
    distributed.check_collectives(True)
    try:
        bounds = SPLITS[world]
        share = range(bounds[rank], bounds[rank + 1])
        audio, text, clip = _data()
        mine = ((clip >= share.start) & (clip < share.stop)).nonzero().squeeze(1)
        result = _build(audio[mine], text[mine], clip[mine], rows=mine, partitioned=True)
        result["held"] = int(mine.numel())
        result["ask"] = _ask_run(_Context(share))
        result["sent"] = distributed.collectives_sent()
        torch.save(result, f"{out}.{rank}")
    finally:
        distributed.destroy_process_group()


def _brute_force(k: int) -> list[np.ndarray]:
    """Top-k of both fine-KB sides over every row, in numpy, own clip excluded."""
    audio, text, clip = (t.numpy() for t in _data())
    u, v, exclude = (t.numpy() for t in _queries())
    ids = np.unique(clip)
    clip_audio = np.stack([audio[clip == c][0] for c in ids])
    mean_text = np.stack([text[clip == c].mean(0) for c in ids])
    mean_text /= np.linalg.norm(mean_text, axis=1, keepdims=True)

    def top(queries: np.ndarray, keys: np.ndarray, key_clip: np.ndarray) -> np.ndarray:
        scores = queries @ keys.T
        scores[key_clip[None, :] == exclude[:, None]] = -np.inf
        return np.argsort(-scores, axis=1, kind="stable")[:, :k]

    rows_a, rows_t = top(u, clip_audio, ids), top(v, text, clip)
    return [clip_audio[rows_a], mean_text[rows_a], text[rows_t], clip_audio[clip[rows_t]]]


@pytest.mark.parametrize("world", [2, 3])
def test_partitioned_kbs_equal_the_whole_kb(world: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from training import knowledge

    monkeypatch.setattr(knowledge, "KMEANS_POINTS_PER_CENTROID", SAMPLE_CAP)  # the single-process build here
    assert SAMPLE_CAP * 5 < len(_data()[2])
    out = str(tmp_path / "kb")
    # spawn, not fork: rank 0 runs faiss's K-Means (OpenMP), and a child forked from a test process whose
    # OpenMP pool (libgomp) or gRPC threads were busy can hang in it (seen under xdist: rank 0 silent until
    # gloo's 60-s timeout); each rank imports torch, faiss and training itself (~3 s) and sets the cap
    mp.start_processes(_worker, args=(world, free_port(), out), nprocs=world, join=True, start_method="spawn")
    ranks = [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
    audio, text, clip = _data()
    alone = _build(audio, text, clip)
    assert sum(r["held"] for r in ranks) == clip.numel() and len({r["held"] for r in ranks}) == world  # uneven
    expected = _brute_force(alone["k"])
    for result in ranks:
        assert result["k"] == alone["k"] == K and result["totals"] == alone["totals"]
        for got, want in zip(result["fine"], expected, strict=True):  # the merged top-K is the whole top-K
            np.testing.assert_allclose(got.numpy(), want, atol=1e-6)
        for got, want in zip(result["coarse_protos"] + result["coarse"], alone["coarse_protos"] + alone["coarse"],
                             strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        single = _ask_run(_Context(None))
        assert len(result["ask"]["rdm"]) == 1 and result["ask"]["rdm"][0] > 0
        np.testing.assert_allclose(result["ask"]["rdm"], single["rdm"], rtol=1e-6)
        np.testing.assert_allclose(result["ask"]["loss"], single["loss"], rtol=1e-5)
        assert {"gather", "broadcast", "all_reduce(max)"} <= set(result["sent"]), result["sent"]


def test_coarse_kmeans_sample_is_by_global_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """Above 256·N_c pairs K-Means trains on a seeded sample by row: one process, same as FAISS input order."""
    from training import knowledge

    monkeypatch.setattr(knowledge, "KMEANS_POINTS_PER_CENTROID", 3)
    sample = knowledge.kmeans_sample(40, 5, seed=1)
    assert sample is not None and len(sample) == 15 and np.all(np.diff(sample) > 0)
    assert knowledge.kmeans_sample(15, 5, seed=1) is None
    np.testing.assert_array_equal(sample, knowledge.kmeans_sample(40, 5, seed=1))
