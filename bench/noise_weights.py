"""How much a method's training target still trusts the noisy pairs (the noisy condition of `tonearm bench quality`).

The DART, ASK and correspondence-distillation papers each carry a per-pair signal that is meant to
move weight away from mismatched (audio, caption) pairs. After training, on the `best/` checkpoint,
this module recomputes that signal for labelled training pairs whose noise status the manifest
records (``meta.noisy_captions``, written by ``tonearm synth --noise`` / the benchmark):

* IOT and every DART variant — ``B·Π_ii``, the instance transport plan's mass on the labelled pair
  (DART Eq. 3–5, ε of the run's config); 1 = the hard InfoNCE target, below 1 = mass moved off.
* distillation — ``p̂_c,ii``, the teachers' soft target on the labelled pair (row softmax of the
  ensemble similarity at the run's τ; correspondence paper, Eq. 4–5); a hard label is 1.
* ASK — ``Ψ_i`` (Eq. 12), the knowledge potential of the pair (text→audio) from knowledge bases
  rebuilt with the trained encoders over the training set, and ``B·Q*_ii``, the OT realignment
  plan's diagonal (Eq. 14).

Pairs are the English captions of the first ``clips`` training clips, in batches of the run's
batch size with distinct clips per batch (each caption position in turn), embedded with the
evaluation crop. Reported per signal: the mean over noisy and over clean pairs, and
``noisy below clean median`` — the share of noisy pairs weighted below the median clean pair
(50 % = the signal does not tell them apart; 100 % = every noisy pair is down-weighted).
Methods with none of these signals (InfoNCE, SigLIP, SVR, KCL/CACL, triplet) give ``None``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

AUDIT_CLIPS = 600
"""Training clips whose English pairs are weighed (the first ones of the split)."""


def has_pair_weights(objective: dict[str, Any]) -> bool:
    """Whether a run's `objective` config has a per-pair signal this audit can read."""
    base = (objective.get("base") or {}).get("name")
    return base == "iot" or bool(objective.get("distill")) or bool(objective.get("knowledge"))


def english_training_pairs(records: Sequence[Any]) -> tuple[list[str], list[int], list[bool], list[int]]:
    """(caption, clip row, noisy?, caption position) of every English caption of `records`."""
    from index.languages import ENGLISH
    from training.data.noise import noisy_positions

    texts, owners, noisy, positions = [], [], [], []
    for row, record in enumerate(records):
        marked = noisy_positions(record)
        for position, caption in enumerate(record.captions.get(ENGLISH, [])):
            texts.append(caption)
            owners.append(row)
            noisy.append(position in marked)
            positions.append(position)
    return texts, owners, noisy, positions


def pair_weight_audit(checkpoint: Path, manifest: Path, *, clips: int = AUDIT_CLIPS) -> dict[str, float] | None:
    """{signal: mean noisy / mean clean / share of noisy pairs below the clean median} or None."""
    from training.checkpoint import load_checkpoint
    from training.evaluate import embed_chunks, embed_texts, load_clip_chunks, load_split

    loaded = load_checkpoint(checkpoint, device="cpu")
    cfg = loaded.config
    objective = cfg.objective.model_dump()
    if not has_pair_weights(objective):
        return None
    train_records = load_split(manifest, data_cfg=cfg.data, split="train")
    records = train_records[:clips]
    texts, owners, noisy, positions = english_training_pairs(records)
    device = torch.device("cpu")
    chunks = load_clip_chunks(records, data_cfg=cfg.data, frontend_cfg=cfg.frontend)

    def embed(model: Any, tokenizer: Any) -> tuple[torch.Tensor, torch.Tensor]:
        audio = embed_chunks(model, chunks, batch_size=cfg.eval.batch_size, device=device)
        text = embed_texts(model, tokenizer, texts, batch_size=cfg.eval.batch_size, device=device)
        return audio[torch.as_tensor(owners)], text

    audio, text = embed(loaded.model, loaded.tokenizer)
    batches = _batches(np.asarray(positions), batch_size=cfg.optim.batch_size)
    signals: dict[str, Callable[[np.ndarray], np.ndarray]] = {}
    if (objective.get("base") or {}).get("name") == "iot":
        signals["B·Π_ii (IOT plan)"] = _iot_signal(audio, text, objective["base"])
    if objective.get("distill"):
        signals["p̂_ii (teacher target)"] = _distill_signal(objective["distill"], chunks, texts, owners, cfg)
    if objective.get("knowledge"):
        signals.update(_ask_signals(loaded, train_records, audio, text, torch.as_tensor(owners)))
    is_noisy = np.asarray(noisy)
    out: dict[str, float] = {"pairs": float(len(texts)), "noisy_pairs": float(is_noisy.sum())}
    for name, signal in signals.items():
        weights = np.concatenate([signal(rows) for rows in batches])
        order = np.concatenate(batches)
        flags = is_noisy[order]
        clean_median = float(np.median(weights[~flags]))
        out[f"{name}|noisy"] = float(weights[flags].mean()) if flags.any() else float("nan")
        out[f"{name}|clean"] = float(weights[~flags].mean())
        out[f"{name}|below"] = float((weights[flags] < clean_median).mean()) if flags.any() else float("nan")
    return out


def _batches(positions: np.ndarray, *, batch_size: int) -> list[np.ndarray]:
    """Row batches with distinct clips: the pairs of one caption position, `batch_size` at a time."""
    batches = []
    for position in np.unique(positions):
        rows = np.flatnonzero(positions == position)
        batches += [rows[i : i + batch_size] for i in range(0, len(rows), batch_size) if len(rows[i : i + batch_size]) > 1]
    return batches


def _iot_signal(audio: torch.Tensor, text: torch.Tensor, base: dict[str, Any]) -> Callable[[np.ndarray], np.ndarray]:
    from training.objectives.iot import IOTConfig
    from training.ot import normalize_cost, pairwise_euclidean, sinkhorn_log_plan

    cfg = IOTConfig.model_validate({k: v for k, v in base.items() if k != "name"})

    def signal(rows: np.ndarray) -> np.ndarray:
        index = torch.as_tensor(rows)
        with torch.no_grad():
            cost = normalize_cost(pairwise_euclidean(audio[index], text[index]), cfg.cost_normalization)
            log_plan = sinkhorn_log_plan(cost, eps=cfg.eps, iters=cfg.iters, tol=cfg.tol)
        return (len(rows) * log_plan.diagonal().exp()).numpy()

    return signal


def _distill_signal(distill: dict[str, Any], chunks: Sequence[np.ndarray], texts: Sequence[str],
                    owners: Sequence[int], cfg: Any) -> Callable[[np.ndarray], np.ndarray]:
    from training.checkpoint import load_checkpoint
    from training.evaluate import embed_chunks, embed_texts
    from training.objectives.distill import ensemble_similarity, parse_distill_config, soft_targets

    config = parse_distill_config(distill)
    device = torch.device("cpu")
    audios, captions = [], []
    for path in config.teachers:
        teacher = load_checkpoint(Path(path), device="cpu")
        clip_emb = embed_chunks(teacher.model, chunks, batch_size=cfg.eval.batch_size, device=device)
        audios.append(clip_emb[torch.as_tensor(list(owners))])
        captions.append(embed_texts(teacher.model, teacher.tokenizer, texts, batch_size=cfg.eval.batch_size,
                                    device=device))
    teacher_audio, teacher_text = torch.stack(audios), torch.stack(captions)

    def signal(rows: np.ndarray) -> np.ndarray:
        index = torch.as_tensor(rows)
        similarity = ensemble_similarity(teacher_audio[:, index], teacher_text[:, index])
        _, target_rows = soft_targets(similarity, config.tau)  # rows = audio, softmax over captions
        return target_rows.diagonal().numpy()

    return signal


def _ask_signals(loaded: Any, train_records: Sequence[Any], audio: torch.Tensor, text: torch.Tensor,
                 owners: torch.Tensor) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """Ψ and the realignment diagonal from knowledge bases rebuilt with the trained encoders."""
    from training.context import LoopContext
    from training.objectives.ask import ASK, inject, knowledge_potential, realignment_plan
    from training.objectives.base import BuildEnv
    from training.objectives.registry import build_objective

    cfg = loaded.config
    env = BuildEnv(languages=tuple(cfg.data.languages), embed_dim=cfg.model.embed_dim)
    objective = build_objective(cfg.objective, env)
    ask = objective.base
    if not isinstance(ask, ASK):
        return {}
    context = LoopContext(model=loaded.model, tokenizer=loaded.tokenizer, train_records=train_records,
                          data_cfg=cfg.data, frontend_cfg=cfg.frontend, batch_size=cfg.eval.batch_size,
                          device=torch.device("cpu"))
    ask.rebuild(context)
    kb = ask.fine_kb or ask.coarse_kb
    assert kb is not None
    settings = ask.config
    adaptive = settings.reliability == "adaptive"

    def neighbourhood(rows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, Any]:
        index = torch.as_tensor(rows)
        u, v = audio[index], text[index]
        exclude = owners[index] if ask.fine_kb is not None else None
        hood = kb.retrieve(u, v, k=kb.effective_k(settings.top_k, exclude=exclude is not None), exclude_clip=exclude)
        return u, v, hood

    def psi(rows: np.ndarray) -> np.ndarray:
        u, _, hood = neighbourhood(rows)
        with torch.no_grad():
            return knowledge_potential(u, hood.text_partner, hood.audio, adaptive=adaptive).numpy()

    def plan_diagonal(rows: np.ndarray) -> np.ndarray:
        u, v, hood = neighbourhood(rows)
        with torch.no_grad():
            if settings.inject:
                u = inject(u, hood.audio.mean(dim=1), rho=settings.rho, form=settings.injection)
                v = inject(v, hood.text.mean(dim=1), rho=settings.rho, form=settings.injection)
            return realignment_plan(v @ u.t(), eps=settings.ot_eps, iters=settings.ot_iters).diagonal().numpy()

    return {"Ψ_i (ASK reliability)": psi, "B·Q*_ii (ASK realignment)": plan_diagonal}
