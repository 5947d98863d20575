"""Milvus backend: a bundle's vectors in Milvus collections, for collections beyond one node.

The bundle directory keeps the encoders, id files and held-out set; only the
vectors move. ``publish`` writes them into two collections named by bundle id
(``<prefix>_<bundle>_audio``: ``row`` = row of ``audio_ids.jsonl``;
``<prefix>_<bundle>_text``: ``row``, ``lang``, ``clip_row``), then records the
bundle in ``<prefix>_published`` — last, so a half-written bundle never counts
as published. The service (``TONEARM_INDEX_BACKEND=milvus``) searches the
collections of the bundle a request leased, so in-flight requests finish on
their bundle during a hot swap; activation then points the aliases
``<prefix>_active_audio`` / ``<prefix>_active_text`` at the new bundle's
collections (``alter_alias`` is atomic), which is what other consumers and
replicas read.

* Language filtering of audio→text search is a Milvus filter expression
  (``lang in [...]``), not post-filtering.
* Index type per collection: ``FLAT`` (exact; what the parity test uses) by
  default, or any Milvus index type (``HNSW``, ``IVF_FLAT``, ``AUTOINDEX``) at publish.
* Milvus Lite (a local ``*.db`` URI; the ``milvus-lite`` 2.x wheel embeds the
  engine) answers ``UNIMPLEMENTED`` to alias calls: there the active pointer
  is a row of ``<prefix>_active`` instead (same meaning, one upsert).

pymilvus is imported lazily: only the ``milvus`` extra needs it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console

from index import bundle as fmt
from index.bundle import BundleManifest, IndexInfo, read_manifest
from index.errors import BundleError, TonearmError
from index.evalset import read_jsonl

log = logging.getLogger(__name__)

DEFAULT_PREFIX = "tonearm"
INSERT_CHUNK = 5000
QUERY_CHUNK = 10_000
LANG_MAX = 32
POINTER_KEY = "active"
INDEX_TYPES = ("FLAT", "IVF_FLAT", "HNSW", "AUTOINDEX")
_NAME = re.compile(r"[^A-Za-z0-9_]")


class MilvusError(TonearmError):
    """Milvus unreachable, or answering an operation with an error."""


class BundleNotPublished(BundleError):
    """The bundle's vectors are not (completely) in Milvus yet."""


@dataclass(frozen=True)
class MilvusTarget:
    """Where the vectors live: ``uri`` (``http://host:19530`` or a Milvus Lite ``*.db`` file)."""

    uri: str
    token: str | None = None
    prefix: str = DEFAULT_PREFIX

    def client(self) -> Any:
        """The process's one client for this URI and token (thread-safe, never closed here).

        pymilvus keys connections by URI and token: closing one client would close the
        connection every other client of the same Milvus uses."""
        key = (self.uri, self.token)
        with _CLIENTS_LOCK:
            if key not in _CLIENTS:
                _CLIENTS[key] = _connect(self.uri, self.token)
            return _CLIENTS[key]

    def collection(self, bundle_id: str, kind: str) -> str:
        """``<prefix>_<bundle id made name-safe>_<hash>_<kind>``: Milvus names allow [A-Za-z0-9_] only."""
        digest = hashlib.sha1(bundle_id.encode()).hexdigest()[:8]
        return f"{self.prefix}_{_NAME.sub('_', bundle_id)}_{digest}_{kind}"

    @property
    def registry(self) -> str:
        return f"{self.prefix}_published"

    @property
    def pointer(self) -> str:
        return f"{self.prefix}_active"

    def alias(self, kind: str) -> str:
        return f"{self.prefix}_active_{kind}"


_CLIENTS: dict[tuple[str, str | None], Any] = {}
_CLIENTS_LOCK = threading.Lock()


def _connect(uri: str, token: str | None) -> Any:
    try:
        from pymilvus import MilvusClient
    except ModuleNotFoundError as err:
        raise MilvusError("the Milvus backend needs pymilvus: pip install 'tonearm[milvus]'") from err
    try:
        return MilvusClient(uri=uri, token=token or "")
    except Exception as err:  # pymilvus raises its own exception family, or grpc's
        raise MilvusError(f"cannot connect to Milvus at {uri}: {_reason(err)}") from None


def _reason(err: BaseException) -> str:
    return (getattr(err, "message", None) or str(err)).splitlines()[0] if str(err) else type(err).__name__


# ----------------------------------------------------------------------------- publish


def _schema(client: Any, dim: int, *, text: bool) -> Any:
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("row", DataType.INT64, is_primary=True)
    if text:
        schema.add_field("lang", DataType.VARCHAR, max_length=LANG_MAX)
        schema.add_field("clip_row", DataType.INT64)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=dim)
    return schema


def _index_params(client: Any, index_type: str) -> Any:
    params = client.prepare_index_params()
    params.add_index(field_name="vector", index_type=index_type, metric_type="IP")
    return params


def _registry_schema(client: Any) -> Any:
    from pymilvus import DataType, MilvusClient

    schema = MilvusClient.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("key", DataType.VARCHAR, is_primary=True, max_length=256)
    schema.add_field("bundle_id", DataType.VARCHAR, max_length=256)
    schema.add_field("info", DataType.VARCHAR, max_length=4096)
    schema.add_field("vector", DataType.FLOAT_VECTOR, dim=2)  # Milvus collections need one vector field
    return schema


def _ensure_registry(client: Any, name: str) -> None:
    if not client.has_collection(name):
        client.create_collection(name, schema=_registry_schema(client), index_params=_index_params(client, "FLAT"))
    client.load_collection(name)


def _lookup(client: Any, registry: str, key: str) -> dict[str, Any] | None:
    if not client.has_collection(registry):
        return None
    client.load_collection(registry)
    rows = client.query(registry, filter=f"key == {json.dumps(key)}", output_fields=["bundle_id", "info"])
    return rows[0] if rows else None


def caption_index(manifest: BundleManifest) -> IndexInfo:
    """The caption index; index-only bundles (`tonearm index`) are served from their FAISS files only."""
    if manifest.text_index is None:
        raise BundleError(
            f"bundle {manifest.bundle_id} has no caption index (built by `tonearm index`); "
            "the Milvus backend serves only bundles from `tonearm export` — serve it with the FAISS backend"
        )
    return manifest.text_index


def bundle_vectors(root: Path, manifest: BundleManifest) -> tuple[np.ndarray, np.ndarray]:
    """(audio, text) vectors of a bundle, read back from its FAISS indices (exact for Flat/HNSW)."""
    from index.faiss_index import all_vectors, load_index, parse_factory

    out = []
    for info in (manifest.audio_index, caption_index(manifest)):
        index = load_index(root / info.file, spec=parse_factory(info.factory, info.dim), search_params={})
        out.append(all_vectors(index))
    return out[0], out[1]


def publish(bundle_dir: Path, target: MilvusTarget, *, index_type: str = "FLAT") -> bool:
    """Write a bundle's vectors to Milvus; False when it was already published (nothing written)."""
    root = Path(bundle_dir)
    manifest = read_manifest(root)
    client = target.client()
    try:
        if _lookup(client, target.registry, manifest.bundle_id) is not None:
            return False
        audio, text = bundle_vectors(root, manifest)
        text_items = read_jsonl(root / caption_index(manifest).ids_file, required=("lang", "clip_row"))
        for kind, vectors in (("audio", audio), ("text", text)):
            name = target.collection(manifest.bundle_id, kind)
            if client.has_collection(name):  # a publish interrupted before its registry row: start over
                client.drop_collection(name)
            client.create_collection(
                name, schema=_schema(client, manifest.embed_dim, text=kind == "text"),
                index_params=_index_params(client, index_type),
            )
            for start in range(0, len(vectors), INSERT_CHUNK):
                rows = []
                for row in range(start, min(start + INSERT_CHUNK, len(vectors))):
                    record: dict[str, Any] = {"row": row, "vector": vectors[row].tolist()}
                    if kind == "text":
                        record["lang"] = str(text_items[row]["lang"])
                        record["clip_row"] = int(text_items[row]["clip_row"])
                    rows.append(record)
                client.insert(name, rows)
            client.flush(name)
        _ensure_registry(client, target.registry)
        info = {"n_audio": len(audio), "n_text": len(text), "index_type": index_type, "dim": manifest.embed_dim}
        client.upsert(target.registry, [
            {"key": manifest.bundle_id, "bundle_id": manifest.bundle_id, "info": json.dumps(info), "vector": [0.0, 0.0]}
        ])
        return True
    except TonearmError:
        raise
    except Exception as err:
        raise MilvusError(f"publishing {manifest.bundle_id} to {target.uri} failed: {_reason(err)}") from None


# ----------------------------------------------------------------------------- search


class MilvusVectorIndex:
    """One collection searched by inner product; rows are the bundle's row numbers."""

    def __init__(self, client: Any, collection: str, *, ntotal: int, dim: int) -> None:
        self.client = client
        self.collection = collection
        self.ntotal = ntotal
        self.d = dim

    def search(
        self, queries: np.ndarray, k: int, languages: Sequence[str] | None = None
    ) -> tuple[np.ndarray, np.ndarray]:
        """Top-``k`` (scores (n, k) float32, rows (n, k) int64; -1 / -inf where fewer hits)."""
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        matrix = np.ascontiguousarray(queries, dtype=np.float32)
        expression = f"lang in {json.dumps(sorted(languages))}" if languages else ""
        try:
            found = self.client.search(
                self.collection, data=matrix.tolist(), limit=k, filter=expression,
                search_params={"metric_type": "IP"}, output_fields=["row"],
            )
        except Exception as err:
            raise MilvusError(f"Milvus search in {self.collection} failed: {_reason(err)}") from None
        scores = np.full((len(matrix), k), -np.inf, dtype=np.float32)
        rows = np.full((len(matrix), k), -1, dtype=np.int64)
        for q, hits in enumerate(found):
            for j, hit in enumerate(hits[:k]):
                scores[q, j] = float(hit["distance"])
                rows[q, j] = int(hit["id"])
        return scores, rows

    def vectors(self) -> np.ndarray:
        """Every vector (row order), for the consistency diagnostics' exact ranks."""
        out = np.zeros((self.ntotal, self.d), dtype=np.float32)
        for start in range(0, self.ntotal, QUERY_CHUNK):
            rows = self.client.query(
                self.collection, filter=f"row >= {start} and row < {start + QUERY_CHUNK}",
                output_fields=["row", "vector"],
            )
            for record in rows:
                out[int(record["row"])] = np.asarray(record["vector"], dtype=np.float32)
        return out


def open_bundle_indices(
    target: MilvusTarget, manifest: BundleManifest
) -> tuple[Any, MilvusVectorIndex, MilvusVectorIndex]:
    """(client, audio index, text index) of a published bundle; :class:`BundleNotPublished` otherwise."""
    client = target.client()
    try:
        record = _lookup(client, target.registry, manifest.bundle_id)
        if record is None:
            raise BundleNotPublished(
                f"bundle {manifest.bundle_id} is not published to Milvus at {target.uri}; "
                f"run: tonearm bundle publish BUNDLE_DIR --milvus-uri {target.uri}"
            )
        info = json.loads(record["info"])
        expected = {"n_audio": manifest.audio_index.ntotal, "n_text": caption_index(manifest).ntotal}
        if any(info.get(key) != value for key, value in expected.items()):
            raise BundleError(f"Milvus holds {info} for bundle {manifest.bundle_id}, its manifest {expected}")
        indices = []
        for kind, n in (("audio", expected["n_audio"]), ("text", expected["n_text"])):
            name = target.collection(manifest.bundle_id, kind)
            client.load_collection(name)
            indices.append(MilvusVectorIndex(client, name, ntotal=n, dim=manifest.embed_dim))
        return client, indices[0], indices[1]
    except TonearmError:
        raise
    except Exception as err:
        raise MilvusError(f"opening bundle {manifest.bundle_id} in Milvus at {target.uri}: {_reason(err)}") from None


# ----------------------------------------------------------------------------- active pointer


def set_active(target: MilvusTarget, bundle_id: str) -> None:
    """Point the active aliases at ``bundle_id``'s collections (atomic per alias); Milvus Lite: the pointer row."""
    client = target.client()
    try:
        try:
            for kind in ("audio", "text"):
                _point_alias(client, target.alias(kind), target.collection(bundle_id, kind))
        except _AliasesUnsupported:
            _ensure_registry(client, target.pointer)
            client.upsert(target.pointer, [
                {"key": POINTER_KEY, "bundle_id": bundle_id, "info": "{}", "vector": [0.0, 0.0]}
            ])
    except Exception as err:
        raise MilvusError(f"cannot mark {bundle_id} active in Milvus at {target.uri}: {_reason(err)}") from None


def active_bundle(target: MilvusTarget) -> str | None:
    """The bundle id the active aliases (or, on Milvus Lite, the pointer row) name; None when unset."""
    client = target.client()
    try:
        collection = client.describe_alias(target.alias("audio")).get("collection_name")
    except Exception as err:
        if not _unimplemented(err):
            return None
        record = _lookup(client, target.pointer, POINTER_KEY)
        return str(record["bundle_id"]) if record else None
    for row in client.query(target.registry, filter="key != ''", output_fields=["bundle_id"]):
        if target.collection(str(row["bundle_id"]), "audio") == collection:
            return str(row["bundle_id"])
    return None


class _AliasesUnsupported(Exception):
    pass


def _unimplemented(err: BaseException) -> bool:
    text = f"{err!r} {getattr(err, 'code', '')}"
    return "UNIMPLEMENTED" in text.upper()


def _point_alias(client: Any, alias: str, collection: str) -> None:
    try:
        client.alter_alias(collection_name=collection, alias=alias)
    except Exception as err:
        if _unimplemented(err):
            raise _AliasesUnsupported from None
        client.create_alias(collection_name=collection, alias=alias)  # first activation: no alias yet


# ----------------------------------------------------------------------------- CLI


def target_from_args(uri: str, token_env: str | None) -> MilvusTarget:
    token = None
    if token_env:
        token = os.environ.get(token_env)
        if not token:
            raise TonearmError(f"--milvus-token-env {token_env}: that environment variable is not set")
    return MilvusTarget(uri=uri, token=token)


def cli_publish(args: argparse.Namespace) -> int:
    """`tonearm bundle publish BUNDLE --milvus-uri URI [--milvus-token-env VAR] [--milvus-index TYPE]`."""
    root = Path(args.bundle)
    if not (root / fmt.MANIFEST_NAME).is_file():
        raise BundleError(f"{root}: not a bundle directory (no {fmt.MANIFEST_NAME})")
    target = target_from_args(args.milvus_uri, args.milvus_token_env)
    manifest = read_manifest(root)
    written = publish(root, target, index_type=args.milvus_index)
    state = "published" if written else "already published (nothing written)"
    Console().print(
        f"{manifest.bundle_id}: {state} to {target.uri} as {target.collection(manifest.bundle_id, 'audio')} "
        f"({manifest.audio_index.ntotal} clips) and {target.collection(manifest.bundle_id, 'text')} "
        f"({caption_index(manifest).ntotal} captions)", highlight=False, soft_wrap=True,
    )
    return 0
