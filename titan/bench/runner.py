"""The load loop: dispatch requests on the arrival schedule (and concurrency cap), scrape metrics, and
watch the client's own health, all on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import math
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx

from titan.bench.arrivals import ArrivalProcess
from titan.bench.client import RequestResult, api_root, endpoint_url, make_client, request_body, send_request
from titan.bench.metrics_scraper import MetricsSample, MetricsScraper
from titan.bench.workload import Workload

MAX_HEALTH_EVENTS = 10_000


@dataclass
class RunConfig:
    base_url: str
    model: str
    endpoint: str = "completions"
    num_requests: int | None = 100
    duration: float | None = None
    max_concurrency: int | None = None
    request_timeout: float = 300.0
    temperature: float = 0.0
    ignore_eos: bool = False
    include_usage: bool = True
    send_priority: bool = False
    api_key: str | None = None
    scrape_metrics: bool = True
    scrape_interval: float = 1.0
    progress: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    warm_prefixes: bool = False  # send Workload.warm_up_requests() before the clock starts


@dataclass
class RunData:
    results: list[RequestResult]
    duration: float  # run start to the last response
    started_at: str  # wall clock, ISO 8601
    metrics: dict[str, Any]  # the scraper's summary (series included)
    scrapes: list[MetricsSample]
    loop_lags: list[tuple[float, float]]
    client_gc: list[tuple[float, float]]
    interrupted: bool
    server_steps: list[dict[str, Any]] = field(default_factory=list)  # Titan's /debug/steps, `t` from start
    server_ready_t: float | None = None  # when the server became ready, seconds from start (Titan only)


class ClientHealth:
    """Measures the client itself: event-loop lag (a ticker that oversleeps) and its own GC pauses.

    A Python client that falls behind stamps tokens late; recording when it did lets the report say
    which part of a spike belongs to the client rather than the server.
    """

    def __init__(self, start: float, tick: float = 0.02, threshold: float = 0.01) -> None:
        self.start = start
        self.tick = tick
        self.threshold = threshold
        self.loop_lags: list[tuple[float, float]] = []
        self.gc_pauses: list[tuple[float, float]] = []
        self._gc_started = 0.0

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._gc_started = now
        elif now - self._gc_started > 0.001 and len(self.gc_pauses) < MAX_HEALTH_EVENTS:
            self.gc_pauses.append((now - self.start, now - self._gc_started))

    @contextlib.contextmanager
    def watching_gc(self) -> Iterator[None]:
        gc.callbacks.append(self._on_gc)
        try:
            yield
        finally:
            gc.callbacks.remove(self._on_gc)

    async def run(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            before = time.perf_counter()
            await asyncio.sleep(self.tick)
            lag = time.perf_counter() - before - self.tick
            if lag > self.threshold and len(self.loop_lags) < MAX_HEALTH_EVENTS:
                self.loop_lags.append((time.perf_counter() - self.start, lag))


class _Progress:
    """A rich progress bar on stderr (silent when disabled or not a terminal)."""

    def __init__(self, enabled: bool, total: float) -> None:
        self.bar: Any = None
        if not enabled:
            return
        from rich.console import Console
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.bar = Progress(TextColumn("[bold]titan bench"), BarColumn(), TextColumn("{task.description}"),
                            TimeElapsedColumn(), console=Console(stderr=True), transient=True)
        self.task = self.bar.add_task("", total=total)

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.__exit__(*exc)

    def update(self, completed: float, done: int, in_flight: int, failed: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=completed,
                            description=f"{done} done, {in_flight} in flight, {failed} failed")


async def _wait(stop: asyncio.Event, awaitable: Any) -> bool:
    """Await `awaitable` unless `stop` fires first; True when it completed."""
    task = asyncio.ensure_future(awaitable)
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({task, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if task not in done:
        task.cancel()
        return False
    return True


async def run_load(config: RunConfig, workload: Workload, arrivals: ArrivalProcess) -> RunData:
    """Run the load once. Ctrl-C stops sending, cancels what is in flight and still returns the data."""
    if config.num_requests is None and config.duration is None:
        raise ValueError("give --num-requests or --duration")
    if config.duration is not None and math.isinf(arrivals.rate) and not config.max_concurrency:
        raise ValueError("--duration with an infinite rate needs --max-concurrency")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):  # not in the main thread
        loop.add_signal_handler(signal.SIGINT, stop.set)
    gc.collect()
    gc.freeze()  # the setup's objects stay out of the client's own collections during the run
    try:
        return await _drive(config, workload, arrivals, stop)
    finally:
        gc.unfreeze()
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.remove_signal_handler(signal.SIGINT)


async def _drive(config: RunConfig, workload: Workload, arrivals: ArrivalProcess, stop: asyncio.Event) -> RunData:
    url = endpoint_url(config.base_url, config.endpoint)
    finished = asyncio.Event()
    semaphore = asyncio.Semaphore(config.max_concurrency) if config.max_concurrency else None
    results: list[RequestResult] = []
    tasks: set[asyncio.Task[Any]] = set()
    counts = {"done": 0, "failed": 0}
    started_at = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    async with make_client(config.request_timeout, config.api_key) as client:
        if config.warm_prefixes:
            await _warm_prefixes(client, url, config, workload)
        start = time.perf_counter()
        start_wall = time.time()
        health = ClientHealth(start)
        scraper = MetricsScraper(client, f"{api_root(config.base_url)}/metrics", start, config.scrape_interval)
        background = [asyncio.create_task(health.run(finished))]
        if config.scrape_metrics:
            background.append(asyncio.create_task(scraper.run(finished)))
        total = float(config.num_requests if config.num_requests is not None else config.duration or 0)
        progress = _Progress(config.progress, total)  # requests done, or seconds of --duration

        async def one(result: RequestResult, body: dict[str, Any]) -> None:
            try:
                await send_request(client, url, body, result, start)
            finally:
                if semaphore is not None:
                    semaphore.release()
                counts["done"] += 1
                counts["failed"] += not result.success
                elapsed = time.perf_counter() - start
                progress.update(counts["done"] if config.num_requests else min(elapsed, total),
                                counts["done"], len(tasks) - 1, counts["failed"])

        try:
            with health.watching_gc(), progress:
                for index, offset in enumerate(arrivals.offsets()):
                    if config.num_requests is not None and index >= config.num_requests:
                        break
                    if config.duration is not None and offset >= config.duration:
                        break
                    spec = workload.request(index)  # built before the wait so it never delays the send
                    body = request_body(spec, config.model, temperature=config.temperature,
                                        ignore_eos=config.ignore_eos, include_usage=config.include_usage,
                                        send_priority=config.send_priority, extra=config.extra_body)
                    delay = start + offset - time.perf_counter()
                    if not await _wait(stop, asyncio.sleep(max(delay, 0.0))):  # sleep(0) lets sends start
                        break
                    if semaphore is not None and not await _wait(stop, semaphore.acquire()):
                        break
                    if (semaphore is not None and config.duration is not None
                            and time.perf_counter() - start >= config.duration):
                        break  # a closed loop can fall behind its schedule; the duration still ends it
                    # (An open loop sends everything its schedule holds: checked there too, a request due just
                    # before the end was dropped whenever the sleep overshot, and two servers driven with the
                    # same seed got different requests.)
                    result = RequestResult(index, spec.request_class, spec.input_tokens, spec.max_tokens, offset)
                    results.append(result)
                    task = asyncio.create_task(one(result, body))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                while tasks and not stop.is_set():
                    await _wait(stop, asyncio.wait(set(tasks)))
        finally:
            for task in list(tasks):
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            ended = time.perf_counter()  # before the final scrape, which is not part of the run
            finished.set()
            await asyncio.gather(*background, return_exceptions=True)
        steps, ready_t = [], None
        if config.scrape_metrics:
            steps, ready_t = await fetch_server_steps(client, api_root(config.base_url), start_wall)
    return RunData(results, ended - start, started_at, scraper.to_dict(), scraper.samples,
                   health.loop_lags, health.gc_pauses, stop.is_set(), steps, ready_t)


async def _warm_prefixes(client: httpx.AsyncClient, url: str, config: RunConfig, workload: Workload) -> None:
    """One request per shared prefix, one at a time, none of them part of the run."""
    for spec in workload.warm_up_requests():
        body = request_body(spec, config.model, temperature=0.0, ignore_eos=False, include_usage=False,
                            send_priority=False, extra=config.extra_body)
        result = RequestResult(spec.index, spec.request_class, spec.input_tokens, spec.max_tokens, 0.0)
        await send_request(client, url, body, result, time.perf_counter())
        if not result.success:
            raise RuntimeError(f"the prefix warm-up request failed: {result.error}")


async def fetch_server_steps(client: httpx.AsyncClient, root: str,
                             start_wall: float) -> tuple[list[dict[str, Any]], float | None]:
    """Titan's recent engine steps (`GET /debug/steps`) and its ready time, timed from the run's start;
    ([], None) elsewhere.

    The server stamps steps with its wall clock; on 127.0.0.1 that is the client's clock too.
    """
    try:
        response = await client.get(f"{root}/debug/steps", params={"limit": 2048}, timeout=10)
        payload = response.json() if response.status_code == 200 else {}
        steps = [{**record, "t": record["time"] - start_wall} for record in payload.get("data", [])
                 if isinstance(record, dict) and {"time", "duration", "num_prefill_tokens",
                                                  "num_preemptions"} <= record.keys()]
        ready = payload.get("ready_time")
        return steps, ready - start_wall if isinstance(ready, int | float) else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return [], None
