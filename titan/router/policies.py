"""Routing policies: given the ready candidates for one request, pick one.

- round-robin: each backend in configured order, skipping those not ready.
- least-load: power of two choices — sample two candidates at random and take the less loaded, where
  load = outstanding requests from this router + the backend's scraped queue (num_requests_waiting)
  + its KV cache usage (0 to 1: breaks ties towards the emptier cache). Two random samples avoid the
  herd that "always the least loaded" sends to one backend between scrapes.
- prefix-affinity: consistent hashing of the prompt's affinity key (request_key.py) with bounded loads:
  the key's owner on the ring takes it unless it already has `limit` outstanding requests, in which case
  the next backend round the ring does, and so on. limit = max(ceil(load_factor × (total + 1) / n),
  min_load) over the n candidates holding `total` outstanding requests: no backend gets more than
  load_factor × its fair share once the fleet is busy, while at low load (under min_load each) a hot
  prefix still stays where its cache is. Requests without a key use least-load.

Outstanding counts are this router's own; with several router replicas each bounds its own share.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from titan.router.hash_ring import HashRing

if TYPE_CHECKING:
    from titan.router.backend import Backend


class Policy(Protocol):
    name: str

    def choose(self, candidates: Sequence[Backend], key: bytes | None) -> Backend:
        """`candidates` is non-empty and in configured order."""
        ...

    def set_backends(self, names: Sequence[str]) -> None:
        """The pool's members changed (the pool calls this at start and on every join or leave)."""
        ...


class RoundRobin:
    name = "round-robin"

    def __init__(self) -> None:
        self.next_index = 0  # configured position of the backend whose turn it is

    def choose(self, candidates: Sequence[Backend], key: bytes | None) -> Backend:
        chosen = next((backend for backend in candidates if backend.index >= self.next_index), candidates[0])
        self.next_index = chosen.index + 1
        return chosen

    def set_backends(self, names: Sequence[str]) -> None:
        pass  # the turn follows pool positions, which newcomers extend


def load(backend: Backend) -> float:
    return backend.outstanding + (backend.waiting or 0.0) + (backend.kv_cache_usage or 0.0)


class LeastLoad:
    name = "least-load"

    def __init__(self, seed: int | None = None) -> None:
        self.random = random.Random(seed)

    def choose(self, candidates: Sequence[Backend], key: bytes | None) -> Backend:
        if len(candidates) == 1:
            return candidates[0]
        first, second = self.random.sample(list(candidates), 2)
        return second if load(second) < load(first) else first

    def set_backends(self, names: Sequence[str]) -> None:
        pass


def bounded_limit(total_outstanding: int, num_candidates: int, load_factor: float, min_load: int) -> int:
    """Outstanding requests a backend may hold before its keys spill to the next one on the ring."""
    return max(math.ceil(load_factor * (total_outstanding + 1) / num_candidates), min_load)


class PrefixAffinity:
    name = "prefix-affinity"

    def __init__(self, names: Sequence[str], load_factor: float = 1.25, min_load: int = 4,
                 seed: int | None = None) -> None:
        self.ring = HashRing(names)  # over every pool member, ready or not, so readiness changes move few keys
        self.load_factor = load_factor
        self.min_load = min_load
        self.fallback = LeastLoad(seed)

    def choose(self, candidates: Sequence[Backend], key: bytes | None) -> Backend:
        if key is None:
            return self.fallback.choose(candidates, key)
        by_name = {backend.name: backend for backend in candidates}
        total = sum(backend.outstanding for backend in candidates)
        limit = bounded_limit(total, len(candidates), self.load_factor, self.min_load)
        for name in self.ring.walk(key):
            backend = by_name.get(name)
            if backend is not None and backend.outstanding < limit:
                return backend
        # Unreachable while load_factor >= 1 (someone is below the mean); kept for safety.
        return min(candidates, key=lambda backend: backend.outstanding)

    def set_backends(self, names: Sequence[str]) -> None:
        # Points depend on names only, so a rebuilt ring moves just the keys of the member that came or went.
        if set(names) != set(self.ring.owners):
            self.ring = HashRing(names)


def make_policy(name: str, backend_names: Sequence[str], load_factor: float = 1.25, min_load: int = 4,
                seed: int | None = None) -> Policy:
    if name == "round-robin":
        return RoundRobin()
    if name == "least-load":
        return LeastLoad(seed)
    if name == "prefix-affinity":
        return PrefixAffinity(backend_names, load_factor, min_load, seed)
    raise ValueError(f"unknown policy {name!r}")
