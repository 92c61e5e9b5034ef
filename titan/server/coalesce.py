"""Identical deterministic requests in flight at once: the first computes, the others wait for its response.

The result cache stores a response once it is complete, so identical requests that arrive while the first
is still running would all miss and compute it again. With coalescing (`--result-cache-coalesce N`, on
with `--result-cache`), the first request with a key leads a `Flight`; up to N later ones with the same
key wait for it and replay its response (`X-Titan-Cache: coalesced`); more than N compute on their own.
A leader that ends without a complete response (aborted, failed, cut by the client) releases its waiters,
which then compute on their own: `FlightRelease`, around the whole ASGI call, makes sure every flight
lands, however its request ended.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import Gauge
from starlette.types import ASGIApp, Receive, Scope, Send

FLIGHTS_KEY = "titan.flights"  # on the scope's state: the flights this request leads


@dataclass
class Flight:
    key: str
    future: asyncio.Future[dict[str, Any] | None]
    waiters: int = 0


@dataclass
class Flights:
    """The flights in progress, by result-cache key (at most one per request in flight)."""

    max_waiters: int  # per flight; 0: no coalescing
    waiting: Gauge  # requests waiting for a flight, now
    flights: dict[str, Flight] = field(default_factory=dict)

    def lead(self, key: str, scope: Scope) -> Flight | None:
        """Start a flight for `key` if none is in progress and the request can guarantee it lands."""
        led = scope.get("state", {}).get(FLIGHTS_KEY)
        if self.max_waiters <= 0 or key in self.flights or led is None:
            return None
        flight = self.flights[key] = Flight(key, asyncio.get_running_loop().create_future())
        led.append(flight)
        return flight

    async def follow(self, key: str) -> dict[str, Any] | None:
        """The response of the flight in progress for `key`; None: none, it is full, or it ended without one."""
        flight = self.flights.get(key)
        if flight is None or flight.waiters >= self.max_waiters:
            return None
        flight.waiters += 1
        self.waiting.inc()
        try:
            return await asyncio.shield(flight.future)  # a waiter that leaves does not cancel the flight
        finally:
            flight.waiters -= 1
            self.waiting.dec()

    def land(self, flight: Flight, entry: dict[str, Any] | None) -> None:
        if not flight.future.done():
            flight.future.set_result(entry)
        if self.flights.get(flight.key) is flight:
            del self.flights[flight.key]


class FlightRelease:
    """Around each HTTP request: the flights it leads land (with no response) once it has ended, if not before."""

    def __init__(self, app: ASGIApp, flights: Flights) -> None:
        self.app = app
        self.flights = flights

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        led: list[Flight] = []
        scope.setdefault("state", {})[FLIGHTS_KEY] = led
        try:
            await self.app(scope, receive, send)
        finally:
            for flight in led:
                self.flights.land(flight, None)
