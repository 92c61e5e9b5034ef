"""Degrade to a faster model: model pools and fallback routing.

With `--pool primary=URL[,URL...] --pool fallback=URL[,URL...]` every request first goes to the primary
pool. When the primary's predicted time to first token for this prompt (the best primary candidate's, as
the score policy predicts it from the router's own queued prefill and the scraped step cost; scoring.py)
exceeds the SLO of the request's class, the request is sent to the fallback pool instead, if it may be:

- batch-class requests (`X-Titan-Priority: batch`) always may;
- interactive ones (the default class) only when they opt in with `X-Titan-Allow-Degrade: true`.

The body's `model` is rewritten to the fallback's model (from its /v1/models), so the response names the
model that served it, and the response carries `X-Titan-Degraded: model=NAME`. Counted in
`titan_router:degraded_requests_total{request_class, model}`. When the primary's prediction falls back under
the SLO, requests go to the primary again. A fallback pool with no ready backend means no degradation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

from prometheus_client import Counter

from titan.router.backend import Backend, BackendPool
from titan.router.request_key import RoutingInfo
from titan.router.scoring import CHARS_PER_TOKEN, DEFAULT_SECONDS_PER_TOKEN

logger = logging.getLogger("titan.router")

PRIMARY, FALLBACK = "primary", "fallback"
POOL_NAMES = (PRIMARY, FALLBACK)
DEGRADED_HEADER = b"x-titan-degraded"
PRIORITY_HEADER = b"x-titan-priority"
OPT_IN_HEADER = b"x-titan-allow-degrade"


@dataclass(frozen=True)
class Decision:
    exclude: frozenset[str]  # backends of the other pool
    info: RoutingInfo
    body: bytes
    degraded_model: str | None = None  # set when the request goes to the fallback pool


def request_class(headers: Sequence[tuple[bytes, bytes]]) -> tuple[str, bool]:
    """(interactive | batch, opted in to degradation) from the request headers."""
    found = {name: value.strip().lower() for name, value in headers if name in (PRIORITY_HEADER, OPT_IN_HEADER)}
    batch = found.get(PRIORITY_HEADER) == b"batch"
    return ("batch" if batch else "interactive"), found.get(OPT_IN_HEADER) in (b"1", b"true", b"yes")


def rewrite_model(body: bytes, model: str) -> bytes | None:
    """The JSON body with `model` replaced (None: not a JSON object, left as is and not degraded)."""
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(parsed, dict):
        return None
    parsed["model"] = model
    return json.dumps(parsed).encode()


class Degrader:
    def __init__(self, pool: BackendPool, registry: object, interactive_slo: float, batch_slo: float) -> None:
        self.pool = pool
        self.slo = {"interactive": interactive_slo, "batch": batch_slo}
        self.counter = Counter("titan_router:degraded_requests_total",
                               "Requests sent to the fallback pool because the primary's predicted TTFT was over "
                               "their class's SLO.", ["request_class", "model"], registry=registry)
        self.last_prediction: float | None = None  # the primary's, for logs and tests

    def members(self, pool_name: str) -> list[Backend]:
        return [backend for backend in self.pool.backends if backend.pool == pool_name]

    def predicted(self, backend: Backend, info: RoutingInfo, now: float) -> float:
        predict = getattr(self.pool.policy, "predicted_ttft", None)  # the score policy's estimate
        if predict is not None:
            return float(predict(backend, info, now)[0])
        cost = backend.seconds_per_token or DEFAULT_SECONDS_PER_TOKEN
        queued = backend.outstanding + (backend.waiting or 0.0)
        return (backend.step_overhead or 0.0) + cost * (queued + 1) * (info.prompt_chars / CHARS_PER_TOKEN + 1)

    def decide(self, info: RoutingInfo, headers: Sequence[tuple[bytes, bytes]], body: bytes) -> Decision:
        primary = [backend for backend in self.members(PRIMARY) if backend.ready]
        fallback = [backend for backend in self.members(FALLBACK) if backend.ready]
        stay = Decision(frozenset(backend.name for backend in self.members(FALLBACK)), info, body)
        if not primary:  # nothing else to do: the fallback serves as the primary would
            return Decision(frozenset(), info, body)
        kind, opted_in = request_class(headers)
        if not fallback or (kind == "interactive" and not opted_in):
            return stay
        now = time.monotonic()
        prediction = min(self.predicted(backend, info, now) for backend in primary)
        self.last_prediction = prediction
        logger.debug("primary's predicted TTFT %.3f s for %d prompt characters (%s SLO %.3f s)", prediction,
                     info.prompt_chars, kind, self.slo[kind])
        if prediction <= self.slo[kind]:
            return stay
        model = next((sorted(backend.models)[0] for backend in fallback if backend.models), None)
        new_body = rewrite_model(body, model) if model is not None else body
        if new_body is None:
            return stay
        self.counter.labels(kind, model or "unknown").inc()
        return Decision(frozenset(backend.name for backend in self.members(PRIMARY)),
                        dataclasses.replace(info, model=model), new_body, model or "unknown")
