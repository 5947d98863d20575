"""The plain reference server bench/service_load.py compares tonearm with: what a user would write by hand.

FastAPI with plain ``def`` routes (FastAPI's thread pool), the *PyTorch* encoders of
the bundle's source checkpoint in eager mode, the bundle's FAISS indices searched
one request at a time; no cache, no micro-batching, no ONNX. Same routes and
request shapes as tonearm's search API, so the same load generator drives both.

    python bench/reference_server.py --bundle BUNDLE_DIR [--checkpoint DIR] --port 8001 [--device cuda]

``--device cuda`` (default: ``TONEARM_REFERENCE_DEVICE``, else cpu) runs the encoders on the GPU:
what the same hand-written server does where one is lent (bench/real_size.py ``reference-cuda``).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import soundfile as sf
import torch
import uvicorn
from fastapi import FastAPI, Request
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from index.audio.decode import eval_chunks  # noqa: E402
from index.bundle.evalset import read_jsonl  # noqa: E402
from index.bundle.format import read_manifest  # noqa: E402
from training.checkpoint import load_checkpoint  # noqa: E402


class TextQuery(BaseModel):
    query: str
    k: int = 10


def create_reference_app(bundle: Path, checkpoint: Path, device: str = "cpu") -> FastAPI:
    manifest = read_manifest(bundle)
    ckpt = load_checkpoint(checkpoint)
    model, tokenizer = ckpt.model.eval().to(device), ckpt.tokenizer
    audio_index = faiss.read_index(str(bundle / manifest.audio_index.file))
    text_index = faiss.read_index(str(bundle / manifest.text_index.file))
    for index, info in ((audio_index, manifest.audio_index), (text_index, manifest.text_index)):
        if info.search_params:
            faiss.ParameterSpace().set_index_parameters(index, ",".join(f"{k}={v}" for k, v in info.search_params.items()))
    audio_ids = [item["id"] for item in read_jsonl(bundle / manifest.audio_index.ids_file, required=("id",))]
    captions = read_jsonl(bundle / manifest.text_index.ids_file, required=("clip_id", "lang", "text"))
    clip_samples = manifest.clip_samples
    app = FastAPI()

    def normalized(x: torch.Tensor) -> np.ndarray:
        return torch.nn.functional.normalize(x, dim=-1).cpu().numpy().astype(np.float32)

    @app.post("/v1/search/text")
    def search_text(body: TextQuery) -> dict[str, Any]:
        ids, mask = tokenizer.encode([body.query])
        with torch.no_grad():
            query = normalized(model.encode_text(torch.from_numpy(ids).to(device), torch.from_numpy(mask).to(device)))
        scores, rows = audio_index.search(query, body.k)
        hits = [{"id": audio_ids[r], "score": float(s)} for s, r in zip(scores[0], rows[0], strict=True) if r >= 0]
        return {"bundle_id": manifest.bundle_id, "hits": hits}

    @app.post("/v1/search/audio")
    async def search_audio(request: Request, k: int = 10) -> dict[str, Any]:
        data = await request.body()
        return await _in_thread(_audio_hits, data, k)

    def _audio_hits(data: bytes, k: int) -> dict[str, Any]:
        wave, rate = sf.read(io.BytesIO(data), dtype="float32", always_2d=True)
        if rate != manifest.sample_rate:
            raise ValueError(f"expected {manifest.sample_rate} Hz audio, got {rate}")
        with torch.no_grad():
            chunks = torch.from_numpy(eval_chunks(wave.mean(axis=1), clip_samples)).to(device)
            query = normalized(model.encode_audio(chunks).mean(dim=0, keepdim=True))
        scores, rows = text_index.search(query, k)
        hits = [
            {"clip_id": captions[r]["clip_id"], "lang": captions[r]["lang"], "text": captions[r]["text"], "score": float(s)}
            for s, r in zip(scores[0], rows[0], strict=True) if r >= 0
        ]
        return {"bundle_id": manifest.bundle_id, "hits": hits}

    @app.get("/readyz")
    def ready() -> dict[str, str]:
        return {"status": "ready", "bundle_id": manifest.bundle_id}

    return app


async def _in_thread(fn: Any, *args: Any) -> Any:
    from starlette.concurrency import run_in_threadpool

    return await run_in_threadpool(fn, *args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bundle", required=True)
    parser.add_argument("--checkpoint", help="default: the source checkpoint recorded in the bundle's manifest")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument("--device", default=os.environ.get("TONEARM_REFERENCE_DEVICE", "cpu"),
                        help="torch device of the encoders (cpu, cuda)")
    args = parser.parse_args()
    bundle = Path(args.bundle)
    checkpoint = Path(args.checkpoint or json.loads((bundle / "manifest.json").read_text())["source"]["checkpoint"])
    torch.set_num_threads(args.threads)
    uvicorn.run(create_reference_app(bundle, checkpoint, args.device), host="127.0.0.1", port=args.port, log_level="warning",
                access_log=False)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
