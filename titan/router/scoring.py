"""The `score` policy: filter, score, pick the best, in the style of the Gateway API inference extension.

For each ready candidate the router estimates two things it can know without asking the backend:

- its expected prefix-cache hit for this prompt. The prompt's text is cut into `chunk_chars` blocks,
  each block's hash chained to the ones before it (vLLM's block hashing, on characters: the router has no
  tokenizer). The router remembers, per backend, the block hashes it recently sent there (an LRU table of
  `score_blocks_per_backend` entries) — the blocks that backend then computed and cached. The hit is the
  share of the prompt's leading blocks found in that backend's table.
- its predicted time to first token: the prefill work the router has queued on it and not yet seen
  finish (a virtual queue that drains at the backend's speed and empties when nothing is open there),
  plus this prompt's own uncached part and one step's overhead, priced with the per-step and per-token
  costs fitted to the backend's scraped step metrics (step_cost.py), scaled by how late that backend's
  recent first tokens came against their predictions (a busy host, a cold replica: Backend.first_token).
  A backend without a fitted cost or a first token yet is priced like its peers (their medians; never slower
  than its step costs say).

score = w_prefix·hit + w_ttft·(best predicted TTFT / this one's) + w_queue·(1 − load / highest load)
        + w_kv·(1 − KV usage),   load = outstanding + scraped waiting

Ties go to the backend with fewer outstanding requests, then round the pool. Hashing plain text into
blocks (rather than one key for the leading characters) is what keeps hot prefixes from piling onto one
replica: a miss costs a predicted prefill that only the replica already holding that prefix avoids, and a
busy replica's virtual queue sends the next newcomer elsewhere.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from titan.router.request_key import RoutingInfo, block_hashes  # noqa: F401 - re-exported

if TYPE_CHECKING:
    from titan.router.backend import Backend
    from titan.router.config import RouterConfig

CHARS_PER_TOKEN = 4.0  # English text under Llama-family tokenizers; only ratios between backends matter
DEFAULT_SECONDS_PER_TOKEN = 0.002  # until a backend's step metrics are scraped


@dataclass(frozen=True)
class ScoreWeights:
    prefix: float = 1.0
    ttft: float = 2.0
    queue: float = 0.5
    kv: float = 0.25


class BlockTable:
    """The block hashes recently sent to one backend, least recently sent first, at most `capacity`."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[bytes, None] = OrderedDict()

    def leading_hits(self, blocks: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks are here (a chain: the first miss ends it)."""
        count = 0
        for block in blocks:
            if block not in self.blocks:
                break
            count += 1
        return count

    def record(self, blocks: Sequence[bytes]) -> None:
        for block in blocks:
            self.blocks[block] = None
            self.blocks.move_to_end(block)
        while len(self.blocks) > self.capacity:
            self.blocks.popitem(last=False)


class VirtualQueue:
    """Prefill seconds the router queued on a backend, draining in real time."""

    def __init__(self) -> None:
        self.busy_until = 0.0

    def wait(self, now: float) -> float:
        return max(0.0, self.busy_until - now)

    def add(self, now: float, seconds: float) -> None:
        self.busy_until = max(self.busy_until, now) + seconds


class ScorePolicy:
    name = "score"

    def __init__(self, weights: ScoreWeights, blocks_per_backend: int, chunk_chars: int) -> None:
        self.weights = weights
        self.blocks_per_backend = blocks_per_backend
        self.chunk_chars = chunk_chars
        self.tables: dict[str, BlockTable] = {}
        self.queues: dict[str, VirtualQueue] = {}
        self.next_index = 0
        self.last: dict[str, float] = {}  # the last decision's scores, for tests and logs
        self.last_prediction: float | None = None  # the last decision's predicted TTFT (seconds)

    def set_backends(self, names: Sequence[str]) -> None:
        for gone in set(self.tables) - set(names):
            del self.tables[gone]
            self.queues.pop(gone, None)

    def forget(self, name: str) -> None:
        """A backend left the pool (failed, restarting): its cache is not to be counted on."""
        self.tables.pop(name, None)
        self.queues.pop(name, None)

    def choose(self, candidates: Sequence[Backend], key: bytes | None) -> Backend:
        return self.choose_for(candidates, RoutingInfo(key=key))

    def predicted_ttft(self, backend: Backend, info: RoutingInfo, now: float,
                       unfitted: tuple[float, float] = (DEFAULT_SECONDS_PER_TOKEN, 0.0),
                       unobserved_calibration: float = 1.0) -> tuple[float, float]:
        """(predicted seconds to first token, expected prefix hit 0..1) for this prompt on `backend`;
        `unfitted`: (seconds per token, step overhead) to price it with until its step metrics are fitted;
        `unobserved_calibration`: its first-token factor until one of its first tokens was seen."""
        table = self.tables.get(backend.name)
        hits = table.leading_hits(info.blocks) if table is not None and info.blocks else 0
        hit = hits / len(info.blocks) if info.blocks else 0.0
        uncached_chars = max(info.prompt_chars - hits * self.chunk_chars, 0)
        fitted = backend.seconds_per_token is not None
        cost = backend.seconds_per_token if fitted else unfitted[0]
        overhead = (backend.step_overhead or 0.0) if fitted else unfitted[1]
        queue = self.queues.get(backend.name)
        waiting = queue.wait(now) if queue is not None and backend.outstanding > 0 else 0.0
        own = overhead + cost * (uncached_chars / CHARS_PER_TOKEN + 1)
        # Step costs fitted on a quiet backend understate a busy host's or a cold replica's: scale this
        # prompt's own part by how late this backend's recent first tokens came against their predictions.
        calibration = backend.ttft_calibration if backend.ttft_observations else unobserved_calibration
        return waiting + calibration * own, hit

    def choose_for(self, candidates: Sequence[Backend], info: RoutingInfo) -> Backend:
        now = time.monotonic()
        weights = self.weights
        unfitted, unobserved = peer_costs(candidates), peer_calibration(candidates)
        predictions = {backend.name: self.predicted_ttft(backend, info, now, unfitted, unobserved)
                       for backend in candidates}
        best_ttft = min(ttft for ttft, _ in predictions.values())
        loads = {backend.name: backend.outstanding + (backend.waiting or 0.0) for backend in candidates}
        top_load = max(loads.values())
        scores: dict[str, float] = {}
        for backend in candidates:
            ttft, hit = predictions[backend.name]
            scores[backend.name] = (weights.prefix * hit + weights.ttft * (best_ttft / ttft if ttft > 0 else 1.0)
                                    + weights.queue * (1.0 - loads[backend.name] / top_load if top_load else 1.0)
                                    + weights.kv * (1.0 - (backend.kv_cache_usage or 0.0)))
        count = max(backend.index for backend in candidates) + 1

        def rank(backend: Backend) -> tuple[float, int, int]:
            return (round(scores[backend.name], 9), -backend.outstanding,
                    -((backend.index - self.next_index) % count))

        chosen = max(candidates, key=rank)
        self.next_index = chosen.index + 1
        self.last = scores
        self.commit(chosen, info, now, predictions[chosen.name][0])
        return chosen

    def commit(self, backend: Backend, info: RoutingInfo, now: float, predicted: float) -> None:
        if info.blocks:
            table = self.tables.setdefault(backend.name, BlockTable(self.blocks_per_backend))
            table.record(info.blocks)
        queue = self.queues.setdefault(backend.name, VirtualQueue())
        if backend.outstanding == 0:
            queue.busy_until = now  # nothing open there: whatever was queued has run
        queue.add(now, predicted - queue.wait(now))
        self.last_prediction = predicted  # the proxy compares it with the first token's arrival


def peer_costs(candidates: Sequence[Backend]) -> tuple[float, float]:
    """(seconds per token, step overhead) to price a backend whose step metrics are not fitted yet: its
    fitted peers' medians (replicas of one pool serve one model). A constant instead made an idle replica,
    never fitted, look slower than the one that had served, so every cold prompt went to that one (26 of 36
    requests on one of three replicas in benchmarks/router_tails.py) and it stayed the only one fitted."""
    fitted = [backend for backend in candidates if backend.seconds_per_token is not None]
    if not fitted:
        return DEFAULT_SECONDS_PER_TOKEN, 0.0
    return (statistics.median(backend.seconds_per_token or 0.0 for backend in fitted),
            statistics.median(backend.step_overhead or 0.0 for backend in fitted))


def peer_calibration(candidates: Sequence[Backend]) -> float:
    """The first-token factor of a backend none of whose first tokens was seen yet: its observed peers'
    median where they answer sooner than their step costs say, else 1 (a slow peer is a busy host, which
    says nothing of this one; an untried backend is never assumed slow, or it would never be tried). At 1
    always, the replica that had served first (a factor below 1) looked faster than the idle ones for every
    new prefix: it and one other took all 36 requests in benchmarks/router_tails.py, the third none."""
    observed = [backend.ttft_calibration for backend in candidates if backend.ttft_observations]
    return min(statistics.median(observed), 1.0) if observed else 1.0


def score_policy(config: RouterConfig) -> ScorePolicy:
    weights = ScoreWeights(config.score_prefix_weight, config.score_ttft_weight, config.score_queue_weight,
                           config.score_kv_weight)
    return ScorePolicy(weights, config.score_blocks_per_backend, config.chunk_chars)
