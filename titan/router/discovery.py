"""Backends found by DNS: the pods of an autoscaled Deployment, through its headless Service's name.

A headless Service's DNS name resolves to one A (or AAAA) record per ready pod. Every `discover_interval`
seconds each `--discover-dns HOST:PORT` is resolved with the event loop's resolver (`loop.getaddrinfo`, run
in a worker thread, so the router never blocks on it), and the pool follows the union of the answers:
an address that appears is added as the backend `ADDRESS:PORT` (it takes requests once a readiness poll
passes, like any backend), one that vanishes is removed (no new requests; open ones finish). A name that
fails to resolve keeps its last good answer: a DNS hiccup, or NXDOMAIN while a rollout has no ready pod,
must not empty the pool. Addresses that are also static `--backend`s are left to those.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Protocol

from titan.router.config import BackendSpec, DnsTarget

logger = logging.getLogger("titan.router")

# host, port → the addresses it resolves to now (an exception when it cannot be resolved).
Resolver = Callable[[str, int], Awaitable[Iterable[str]]]

FAMILIES = {"any": socket.AF_UNSPEC, "ipv4": socket.AF_INET, "ipv6": socket.AF_INET6}


def dns_resolver(family: str = "any") -> Resolver:
    """The system resolver (/etc/hosts, then DNS: what cluster DNS answers in a pod), off the event loop."""

    async def resolve(host: str, port: int) -> list[str]:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, family=FAMILIES[family],
                                                              type=socket.SOCK_STREAM)
        return [str(info[4][0]) for info in infos]

    return resolve


def backend_for(address: str, port: int, pool: str | None = None) -> BackendSpec:
    """A discovered address as a backend, named like a static one: its host:port; in its name's model pool."""
    netloc = f"[{address}]:{port}" if ":" in address else f"{address}:{port}"
    return BackendSpec(f"http://{netloc}", netloc, pool)


class Membership(Protocol):
    """What discovery changes: the router's pool, its health polling and metrics (RouterApp)."""

    def add_backend(self, spec: BackendSpec) -> None: ...

    def remove_backend(self, name: str, reason: str) -> None: ...


class DnsDiscovery:
    def __init__(self, targets: Sequence[DnsTarget], members: Membership, interval: float, resolver: Resolver,
                 static: Iterable[BackendSpec] = ()) -> None:
        self.targets = list(targets)
        self.members = members
        self.interval = interval
        self.resolver = resolver
        static = list(static)
        self.static_names = {spec.name for spec in static}
        self.static_urls = {spec.url for spec in static}
        self.answers: dict[DnsTarget, dict[str, BackendSpec]] = {}  # each name's last good answer
        self.joined: dict[str, DnsTarget] = {}  # the backends discovery put in the pool, and whose answer
        self.failing: set[DnsTarget] = set()  # names whose last resolution failed (warned once per streak)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Resolves once before returning, so the pool is complete before the router takes requests."""
        await self.refresh_logged()
        self.task = asyncio.create_task(self.run())

    async def stop(self) -> None:
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None

    async def run(self) -> None:
        while True:  # `start` resolved just now: wait first
            await asyncio.sleep(self.interval)
            await self.refresh_logged()

    async def refresh_logged(self) -> None:
        try:
            await self.refresh()
        except Exception:  # discovery must never die: the pool would freeze in its last state
            logger.exception("backend discovery failed")

    async def refresh(self) -> tuple[list[str], list[str]]:
        """Resolve every name once and bring the pool in line; (names added, names removed)."""
        results = await asyncio.gather(*(self.resolver(target.host, target.port) for target in self.targets),
                                       return_exceptions=True)
        for target, result in zip(self.targets, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                self.resolution_failed(target, result)
                continue
            if target in self.failing:
                self.failing.discard(target)
                logger.info("discovery: %s resolves again", target)
            self.answers[target] = self.usable(result, target)
        desired: dict[str, tuple[BackendSpec, DnsTarget]] = {}
        for target, specs in self.answers.items():
            for name, spec in specs.items():
                desired.setdefault(name, (spec, target))
        removed = [name for name in self.joined if name not in desired]
        added = [name for name in desired if name not in self.joined]
        for name in removed:
            self.members.remove_backend(name, f"no longer in the DNS answer for {self.joined.pop(name)}")
        for name in added:
            spec, target = desired[name]
            self.members.add_backend(spec)
            self.joined[name] = target
        return added, removed

    def usable(self, addresses: Iterable[str], target: DnsTarget) -> dict[str, BackendSpec]:
        specs: dict[str, BackendSpec] = {}
        for address in addresses:
            if "%" in address:  # an IPv6 link-local address with a zone: no URL can carry it
                continue
            spec = backend_for(address, target.port, target.pool)
            if spec.name in self.static_names or spec.url in self.static_urls:
                continue  # a --backend already: polled and named as configured
            specs[spec.name] = spec
        return specs

    def resolution_failed(self, target: DnsTarget, error: Exception) -> None:
        if target in self.failing:
            return
        self.failing.add(target)
        kept = len(self.answers.get(target, {}))
        logger.warning("discovery: cannot resolve %s (%s: %s); keeping its last %d addresses until it resolves",
                       target, type(error).__name__, error, kept)
