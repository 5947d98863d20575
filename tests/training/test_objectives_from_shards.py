"""Every objective from shards (SPEC §13, issue 39 item 1): the ASK preset and ``distill_stage2`` train
from ``data.shards`` and build the same objects as the same run from the manifest — knowledge-base
rows and teacher embeddings, keyed by clip id (the rows of the two runs differ: records.jsonl is in
shard order). The reference is the manifest run; the shard run streams through loader workers on 2
gloo ranks."""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import ROOT, TINY_CONFIG
from tests.ranks import spawn_ranks

LANGUAGES = ["eng", "fra", "deu", "spa", "nld", "cat", "jpn", "zho"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def tiny_shards(tiny_corpus: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny corpus (32 train clips of 2-4 s) in shards of 8: 4 train shards, 1 per rank × worker of 2 × 2."""
    from training.data.shards import shard_manifest

    out = tmp_path_factory.mktemp("objective_shards")
    shard_manifest(tiny_corpus, out, sample_rate=16_000, shard_size=8, workers=1, progress=False)
    return out


def preset_objective(path: Path, **changes: Any) -> str:
    """The preset's whole ``objective`` section (as an override), with ``changes`` to its wrapper keys."""
    from training.config import load_train_config

    objective = load_train_config(path, []).objective.model_dump(mode="json", exclude_none=True)
    for key, value in changes.items():
        objective[key] = {**objective[key], **value}
    return "objective=" + json.dumps(objective)


def run_overrides(source: list[str], objective: str, out: Path, checkpoint: Path) -> list[str]:
    # Both runs start from the same weights and tokenizer; 4-s crops cover every clip (so distillation's
    # `cache: auto` caches teacher audio per clip and the crop is the whole clip in both runs).
    return [*source, objective, f"model.init_checkpoint={checkpoint}", f"out_dir={out}", "optim.epochs=1",
            "optim.batch_size=4", "optim.warmup_steps=1", "data.clip_seconds=4.0", "distributed.timeout_s=120",
            "eval.select_metric=t2a_R@10_eng"]


def objects_of(overrides: list[str]) -> dict[str, Any]:
    """Train one epoch per ``overrides`` (train()'s own steps) and return what the objective built,
    keyed by clip id: the fine knowledge base's rows, the teachers' cached embeddings."""
    from training.config import load_train_config
    from training.loop import build_run, prepare_out_dir, run_epochs
    from training.objectives.ask import ASK
    from training.runtime import seed_everything, setup_runtime, teardown_runtime

    cfg = load_train_config(TINY_CONFIG, overrides)
    runtime = setup_runtime(device="cpu", amp=False, threads=1, timeout_s=120)
    try:
        prepare_out_dir(cfg, runtime, command="test")
        seed_everything(cfg.seed + runtime.rank)
        run = build_run(cfg, runtime)
        run_epochs(run)
        ids = [r.id for r in run.context._records]
        out: dict[str, Any] = {"steps": run.state.step}
        ask = next((m for m in run.objective.modules() if isinstance(m, ASK)), None)
        if ask is not None:
            assert ask.fine_kb is not None and ask.builds == 1
            side = ask.fine_kb.text
            # .clone(): on CPU a KB's keys are a view of FAISS's own storage, freed with the index.
            out["kb_audio"] = {ids[int(c)]: row.clone() for c, row in zip(ask.fine_kb.audio.clip, ask.fine_kb.audio.keys,
                                                                 strict=True)}
            out["kb_audio_partner"] = {ids[int(c)]: row.clone() for c, row in zip(ask.fine_kb.audio.clip,
                                                                         ask.fine_kb.audio.partners, strict=True)}
            texts: dict[str, list[torch.Tensor]] = {}
            for c, row in zip(side.clip, side.keys, strict=True):
                texts.setdefault(ids[int(c)], []).append(row.clone())
            out["kb_text"] = {k: torch.stack(v) for k, v in texts.items()}
        if run.teachers is not None:
            out["teacher_audio"] = {str(k): v for k, v in run.teachers.audio_cache_rows().items()}
            out["teacher_text"] = dict(run.teachers._text._rows)
            out["cache_audio"] = run.teachers.cache_audio
        return out
    finally:
        teardown_runtime(runtime)


def _shard_worker(rank: int, world: int, ports: list[int], runs: dict[str, list[str]], out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    torch.set_num_threads(1)
    got = {}
    for port, (name, overrides) in zip(ports, runs.items(), strict=True):
        os.environ["MASTER_PORT"] = str(port)
        got[name] = objects_of(overrides)
    torch.save(got, f"{out}.{rank}")


def assert_rows_equal(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(expected)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5, msg=lambda m, k=key: f"{k}: {m}")


def test_ask_and_distillation_presets_train_from_shards_as_from_the_manifest(
    tiny_corpus: Path, tiny_shards: Path, tiny_checkpoint: Path, tmp_path: Path
) -> None:
    ask = preset_objective(ROOT / "configs" / "ask" / "ask.yaml")
    distill = preset_objective(ROOT / "configs" / "distill_stage2.yaml",
                               distill={"teachers": [str(tiny_checkpoint)] * 2})
    shards = [f"data.shards={tiny_shards}", "data.manifest=null", "data.num_workers=2"]
    runs = {"ask": run_overrides(shards, ask, tmp_path / "ask_shards", tiny_checkpoint),
            "distill": run_overrides(shards, distill, tmp_path / "distill_shards", tiny_checkpoint)}
    out = str(tmp_path / "objects")
    spawn_ranks(_shard_worker, args=(2, [free_port(), free_port()], runs, out), nprocs=2)
    ranks = [torch.load(f"{out}.{rank}") for rank in (0, 1)]

    manifest = [f"data.manifest={tiny_corpus}"]
    reference_ask = objects_of(run_overrides(manifest, ask, tmp_path / "ask_manifest", tiny_checkpoint))
    reference_distill = objects_of(run_overrides(manifest, distill, tmp_path / "distill_manifest", tiny_checkpoint))

    # ASK: the fine KB of all 32 clips and their 8-language captions, row for row the manifest run's
    # (built at the first epoch from the same weights), partitioned: each rank holds the clips it
    # embedded, the two shares are disjoint and together the whole.
    assert len(reference_ask["kb_audio"]) == 32
    for key in ("kb_audio", "kb_audio_partner", "kb_text"):
        held = [got["ask"][key] for got in ranks]
        assert held[0] and held[1] and not set(held[0]) & set(held[1])
        assert_rows_equal({**held[0], **held[1]}, reference_ask[key])
    assert all(got["ask"]["steps"] == 4 for got in ranks)  # 32 clips / (2 ranks × batch 4)

    # Distillation: the teacher audio cache is sharded by clip id over the two ranks; together they
    # hold every clip the epoch trained, each with the manifest run's teacher embedding.
    assert reference_distill["cache_audio"] and all(got["distill"]["cache_audio"] for got in ranks)
    held = [got["distill"]["teacher_audio"] for got in ranks]
    assert not set(held[0]) & set(held[1])
    assert len(held[0]) > 0 and len(held[1]) > 0
    assert_rows_equal({**held[0], **held[1]}, reference_distill["teacher_audio"])
    assert len(reference_distill["teacher_audio"]) == 32
    # Text: cached per caption string; each run drew its own captions (seeded by the clip's row), so
    # the shard run's are checked against the teacher checkpoint itself.
    from training.checkpoint import load_checkpoint

    teacher = load_checkpoint(tiny_checkpoint)
    for got in ranks:
        texts = sorted(got["distill"]["teacher_text"])
        assert len(texts) >= 16
        ids, mask = teacher.tokenizer.encode(texts)
        with torch.no_grad():
            direct = teacher.model.eval().encode_text(torch.as_tensor(ids), torch.as_tensor(mask)).float()
        expected = {t: torch.stack([row, row]) for t, row in zip(texts, direct, strict=True)}  # 2 teachers
        assert_rows_equal(got["distill"]["teacher_text"], expected)


@pytest.mark.parametrize("policy", ["center", "chunk"])
def test_knowledge_pass_streams_the_train_shards_by_clip_id(
    tiny_corpus: Path, tiny_shards: Path, tiny_checkpoint: Path, policy: str
) -> None:
    """One process, two loader workers: the pairs of the shard pass are the manifest pass's, keyed by
    clip id (1-s windows: chunk-and-average gives 2-4 windows a clip)."""
    from training.checkpoint import load_checkpoint
    from training.config import DataConfig
    from training.context import LoopContext
    from training.data.manifest import load_manifest
    from training.data.stream import open_corpus

    checkpoint = load_checkpoint(tiny_checkpoint)
    data = DataConfig(clip_seconds=1.0, eval_crop=policy, languages=LANGUAGES)  # type: ignore[arg-type]
    corpus = open_corpus(str(tiny_shards), languages=LANGUAGES, drop_other_languages=False)

    def pairs(records: list[Any], **extra: Any) -> dict[tuple[str, int], tuple[torch.Tensor, torch.Tensor]]:
        context = LoopContext(model=checkpoint.model, tokenizer=checkpoint.tokenizer, train_records=records,
                              data_cfg=data, frontend_cfg=checkpoint.config.frontend, batch_size=8,
                              device=torch.device("cpu"), **extra)
        audio, text, clip = context.embed_training_pairs()
        out, seen = {}, {}
        for a, t, c in zip(audio, text, clip.tolist(), strict=True):
            clip_id = records[c].id
            seen[clip_id] = seen.get(clip_id, -1) + 1
            out[(clip_id, seen[clip_id])] = (a, t)
        return out

    expected = pairs(load_manifest(tiny_corpus, languages=LANGUAGES, split="train"))
    got = pairs(corpus.records["train"], corpus=corpus, num_workers=2)
    assert set(got) == set(expected) and len(expected) > 32
    for key, (audio, text) in expected.items():
        torch.testing.assert_close(got[key][0], audio, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got[key][1], text, rtol=1e-4, atol=1e-5)


def test_knowledge_pass_leaves_an_undecodable_clip_out_under_the_runs_autocast(
    tiny_shards: Path, tiny_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A sample whose audio bytes are corrupted after sharding: its pairs are not in the knowledge-base
    pass (a zero row would be a false neighbour) and it is named in a warning; every other clip of the
    shards is (the reference: the shards' own members). The pass runs under the autocast it is given."""
    import contextlib
    import shutil

    import webdataset as wds

    from training.checkpoint import load_checkpoint
    from training.config import DataConfig
    from training.context import LoopContext
    from training.data.stream import open_corpus

    shards = tmp_path / "shards"
    shutil.copytree(tiny_shards, shards)
    victim = shards / "train-000001.tar"
    samples = list(wds.WebDataset(str(victim), shardshuffle=False))
    bad_id = json.loads(samples[2]["json"])["id"]
    victim.unlink()
    with wds.TarWriter(str(victim)) as writer:
        for i, sample in enumerate(samples):
            writer.write({"__key__": sample["__key__"], "json": sample["json"],
                          "flac": b"fLaC" + bytes(512) if i == 2 else sample["flac"]})
    members = {json.loads(s["json"])["id"] for tar in sorted(shards.glob("train-*.tar"))
               for s in wds.WebDataset(str(tar), shardshuffle=False)}

    entered = []

    @contextlib.contextmanager
    def autocast() -> Any:
        entered.append(True)
        yield

    checkpoint = load_checkpoint(tiny_checkpoint)
    corpus = open_corpus(str(shards), languages=LANGUAGES, drop_other_languages=False)
    records = corpus.records["train"]
    context = LoopContext(model=checkpoint.model, tokenizer=checkpoint.tokenizer, train_records=records,
                          data_cfg=DataConfig(eval_crop="center", languages=LANGUAGES),  # type: ignore[arg-type]
                          frontend_cfg=checkpoint.config.frontend, batch_size=16, device=torch.device("cpu"),
                          corpus=corpus, autocast=autocast)
    with caplog.at_level("WARNING"):
        audio, text, clip = context.embed_training_pairs()
    kept = {records[int(c)].id for c in clip}
    assert kept == members - {bad_id} and len(members) == 32
    assert bool((audio.norm(dim=1) > 0.99).all()) and audio.shape[0] == text.shape[0] == clip.shape[0]
    assert entered
    assert any("left out of the knowledge base" in r.message and bad_id in r.message for r in caplog.records)
