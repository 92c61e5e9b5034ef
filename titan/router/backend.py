"""One backend's routing state, and the pool that hands a request to a policy.

Backends join and leave the pool at run time (discovery.py). One that leaves is out of routing at once but
stays `retiring` while requests it already took are open; only when the last of them ends is it gone.

Everything here runs on the router's one event loop, so plain attributes need no locks.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

from titan.router.config import BackendSpec
from titan.router.policies import Policy
from titan.router.request_key import RoutingInfo


def say(message: str) -> None:
    """Pool changes are printed whatever the log level: operators need them (as `titan serve` does)."""
    print(f"[titan] router: {message}", file=sys.stderr, flush=True)


CALIBRATION_RANGE = (0.25, 20.0)


@dataclass(eq=False)
class Backend:
    url: str
    name: str
    index: int  # position in the pool: configured order, then order of joining (round-robin order)
    ready: bool = False  # no requests until the first poll says so
    outstanding: int = 0  # requests this router has open on it (sent, response not finished)
    waiting: float | None = None  # scraped num_requests_waiting (None: not scraped / not exposed)
    kv_cache_usage: float | None = None  # scraped kv_cache_usage_perc, 0 to 1
    seconds_per_token: float | None = None  # fitted from scraped step metrics (step_cost.py)
    step_overhead: float | None = None  # seconds per engine step beyond its tokens (step_cost.py)
    models: frozenset[str] | None = None  # model ids from /v1/models (None: unknown, may serve anything)
    readiness_path: str = "/ready"  # Titan's; "/health" once a backend answers 404 to /ready
    not_ready_reason: str = field(default="not polled yet")
    retired: bool = False  # left the pool (no longer discovered): no new requests, open ones finish
    pool: str | None = None  # model pool (degrade.py), None without pools
    # How far the score policy's first-token predictions run behind what this backend really does
    # (observed / predicted, a moving factor): a busy host or a cold replica is slower than its step costs say.
    ttft_calibration: float = 1.0
    ttft_observations: int = 0  # first tokens that moved it (none: priced like its peers, scoring.py)

    def serves(self, model: str | None) -> bool:
        return model is None or self.models is None or model in self.models

    def first_token(self, predicted: float, observed: float) -> None:
        """A stream predicted to answer in `predicted` s produced its first token after `observed` s; each
        observation moves the factor by at most √2 either way."""
        if predicted <= 0:
            return
        ratio = min(max(observed / predicted, 0.5), 2.0)
        self.ttft_observations += 1
        self.ttft_calibration = min(max(self.ttft_calibration * ratio**0.5, CALIBRATION_RANGE[0]),
                                    CALIBRATION_RANGE[1])


class BackendPool:
    def __init__(self, specs: Iterable[BackendSpec], policy: Policy) -> None:
        self.backends = [Backend(spec.url, spec.name, index, pool=spec.pool) for index, spec in enumerate(specs)]
        self.next_index = len(self.backends)
        self.retiring: dict[str, Backend] = {}  # removed, with requests still open on them
        self.policy = policy
        self.policy.set_backends(self.names)

    @property
    def names(self) -> list[str]:
        return [backend.name for backend in self.backends]

    def get(self, name: str) -> Backend | None:
        return next((backend for backend in self.backends if backend.name == name), None)

    def add(self, spec: BackendSpec) -> Backend:
        """A new member, out of rotation until a readiness poll lets it in. A retiring backend of the same
        name comes back as itself, so its open requests stay counted against it."""
        if self.get(spec.name) is not None:
            raise ValueError(f"backend {spec.name} is already in the pool")
        backend = self.retiring.pop(spec.name, None)
        if backend is None:
            backend = Backend(spec.url, spec.name, self.next_index, pool=spec.pool)
        else:
            backend.url, backend.index, backend.retired, backend.pool = spec.url, self.next_index, False, spec.pool
            backend.readiness_path, backend.not_ready_reason = "/ready", "not polled yet"
        self.next_index += 1
        self.backends.append(backend)  # highest index last: the list stays in round-robin order
        self.policy.set_backends(self.names)
        say(f"backend {spec.name} ({spec.url}) added; it joins once it is ready")
        return backend

    def remove(self, name: str, reason: str) -> Backend | None:
        """Out of routing now; kept as retiring while it has open requests (see `release`)."""
        backend = self.get(name)
        if backend is None:
            return None
        self.backends.remove(backend)
        backend.ready, backend.retired = False, True
        backend.not_ready_reason = f"removed: {reason}"
        if backend.outstanding > 0:
            self.retiring[name] = backend
        self.policy.set_backends(self.names)
        say(f"backend {name} ({backend.url}) removed: {reason}"
            + (f"; {backend.outstanding} open requests finish there" if backend.outstanding else ""))
        return backend

    def release(self, backend: Backend) -> bool:
        """One request on `backend` ended; True when that made a retiring backend gone for good."""
        backend.outstanding -= 1
        if backend.retired and backend.outstanding == 0 and self.retiring.get(backend.name) is backend:
            del self.retiring[backend.name]
            return True
        return False

    @property
    def ready(self) -> list[Backend]:
        return [backend for backend in self.backends if backend.ready]

    def set_ready(self, backend: Backend, ready: bool, reason: str = "") -> None:
        if backend.retired:
            return  # out of the pool for good: a late poll or a failure on an open request changes nothing
        if ready != backend.ready:
            if ready:
                say(f"backend {backend.name} ({backend.url}) joined the pool")
            else:
                say(f"backend {backend.name} ({backend.url}) left the pool: {reason}")
        if not ready and backend.ready:
            forget = getattr(self.policy, "forget", None)  # a policy that tracks per-backend cache state
            if forget is not None:
                forget(backend.name)
        backend.ready = ready
        backend.not_ready_reason = "" if ready else reason

    def candidates(self, model: str | None, exclude: set[str]) -> list[Backend]:
        """Ready backends not yet tried; those known to serve `model` when any does (else all: the
        backend will answer an unknown model with its own 404)."""
        ready = [backend for backend in self.backends if backend.ready and backend.name not in exclude]
        serving = [backend for backend in ready if backend.serves(model)]
        return serving or ready

    def choose(self, info: RoutingInfo, exclude: set[str]) -> Backend | None:
        candidates = self.candidates(info.model, exclude)
        if not candidates:
            return None
        choose_for = getattr(self.policy, "choose_for", None)  # policies that read more than the key
        if choose_for is not None:
            return choose_for(candidates, info)
        return self.policy.choose(candidates, info.key)
