"""The engine behind the HTTP server: one dedicated thread owns the LLMEngine and runs its loop.

How the two loops share the cores (measured in benchmarks/serving_overhead.py):
- The engine thread loads the model, warms it up, then loops: take queued commands (add / abort),
  run one `engine.step()`, hand that step's outputs to the event loop in ONE
  `loop.call_soon_threadsafe` call. Torch releases the GIL inside its kernels, so the event loop runs
  HTTP parsing, JSON and SSE writes while the model computes; a separate engine process (vLLM V1's
  choice) would add serialization and a second interpreter's memory for no gain on two cores.
- Nothing on the HTTP side touches engine state: requests enter through a thread-safe command queue
  that the engine thread drains between steps, so an abort (client gone) takes effect before the next
  step runs, and the aborted request's KV blocks are freed then.
- Prompt tokenization and chat templating run on the HTTP side (see app.py), never inside a step;
  incremental detokenization stays in the engine's output processor (a few microseconds per token).
- Per-step metrics are written by the engine thread, per-request ones by the event loop as it
  delivers outputs (metrics.py).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from titan.engine.admission import AdmissionRejectedError
from titan.engine.llm_engine import EngineInfo, LLMEngine
from titan.engine.outputs import RequestOutput
from titan.engine.sampling_params import SamplingParams
from titan.engine.step_observer import StepRecord
from titan.server.metrics import ServerMetrics

logger = logging.getLogger("titan.server")


@dataclass
class EngineRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)  # when the HTTP request came in
    prompt_index: int = 0  # which prompt of its HTTP request: the n choices of one prompt form one group
    cache_salt: str | None = None  # only requests with the same salt share prefix-cache blocks


class RequestRejected(Exception):
    """The engine refused a request (it can never fit); `param` names the cause."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


class EngineFailed(RuntimeError):
    """An engine step raised; every request in flight at that moment fails with this."""


@dataclass
class _Abort:
    request_id: str


@dataclass
class _StepsSnapshot:
    """Asks the engine thread for a copy of its recent step records (the ring buffer is its own)."""

    limit: int
    result: asyncio.Future[tuple[StepRecord, ...]]


_STOP = object()


@dataclass
class _Group:
    """The n choices of one prompt, for the request-level metrics recorded once all of them finished."""

    n: int
    max_tokens: int | None  # None: up to the context limit (the metric then records what was generated)
    unfinished: int
    max_generation_tokens: int = 0


@dataclass
class _Tracked:
    """Loop-side bookkeeping of one engine request."""

    output_queue: asyncio.Queue[RequestOutput | BaseException]
    accepted: asyncio.Future[dict[str, dict[str, int]]]  # resolves to the degradations admission applied
    group: _Group
    last_token_time: float | None = None
    finished: bool = False


@dataclass
class OutputStream:
    """The outputs of a group of engine requests (one HTTP request), merged in arrival order."""

    engine: AsyncEngine
    request_ids: list[str]
    output_queue: asyncio.Queue[RequestOutput | BaseException]
    unfinished: set[str] = field(default_factory=set)
    degradations: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)  # request id → applied

    def __post_init__(self) -> None:
        self.unfinished = set(self.request_ids)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while self.unfinished:
            item = await self.output_queue.get()
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                self.unfinished.discard(item.request_id)
            yield item

    def abort(self) -> None:
        """Abort whatever has not finished (client gone, or an error elsewhere in the group)."""
        for request_id in self.unfinished:
            self.engine.abort(request_id)
        self.unfinished.clear()


class AsyncEngine:
    def __init__(self, engine_factory: Callable[[], LLMEngine], warmup: bool = True,
                 metrics_factory: Callable[[LLMEngine], ServerMetrics] | None = None) -> None:
        self._factory = engine_factory
        self._warmup = warmup
        self._metrics_factory = metrics_factory or default_metrics
        self._commands: queue.SimpleQueue[EngineRequest | _Abort | _StepsSnapshot | object] = queue.SimpleQueue()
        self._tracked: dict[str, _Tracked] = {}
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Written once by the engine thread before `ready` is set; read-only afterwards. The engine itself
        # stays on its thread: the HTTP side sees only its frozen info.
        self.info: EngineInfo | None = None
        self.metrics: ServerMetrics | None = None
        self.load_seconds = 0.0
        self.warmup_seconds = 0.0
        self.error: BaseException | None = None  # load failure or a dead engine thread
        self.ready_time: float | None = None  # wall clock when it became ready (cold-start attribution)
        # asyncio events bind to the running loop on first use, so they can be made here.
        self.ready = asyncio.Event()  # loaded and warmed up
        self.done = asyncio.Event()  # the engine thread has exited (see `error`)

    # ---- lifecycle (event loop) ----------------------------------------------------------------
    def start(self) -> None:
        """Start the engine thread; it loads and warms up the model, then sets `ready`."""
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="titan-engine", daemon=True)
        self._thread.start()

    async def stop(self) -> None:
        if self._thread is None:
            return
        self._commands.put(_STOP)
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_in_flight(self) -> int:
        return len(self._tracked)

    # ---- requests (event loop) -----------------------------------------------------------------
    async def submit(self, requests: list[EngineRequest]) -> OutputStream:
        """Queue requests as one group; returns once the engine took all of them.

        Raises RequestRejected (the others of the group are aborted) if the engine refuses one, and
        EngineFailed if the engine thread is gone.
        """
        if not self.alive:
            raise EngineFailed(f"the engine is not running: {self.error}")
        loop = asyncio.get_running_loop()
        output_queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        stream = OutputStream(self, [r.request_id for r in requests], output_queue)
        accepted = []
        sizes = Counter(request.prompt_index for request in requests)
        groups: dict[int, _Group] = {}
        for request in requests:
            group = groups.get(request.prompt_index)
            if group is None:
                size = sizes[request.prompt_index]
                group = groups[request.prompt_index] = _Group(size, request.sampling_params.max_tokens, size)
            tracked = _Tracked(output_queue, loop.create_future(), group)
            self._tracked[request.request_id] = tracked
            accepted.append(tracked.accepted)
            self._commands.put(request)
        try:
            results = await asyncio.gather(*accepted, return_exceptions=True)
        except BaseException:  # cancelled: the client left before the engine took the requests
            stream.abort()
            raise
        errors = [result for result in results if isinstance(result, BaseException)]
        if errors:
            stream.abort()
            raise errors[0]
        stream.degradations = {request.request_id: result for request, result in zip(requests, results, strict=True)
                               if result}
        return stream

    async def recent_steps(self, limit: int) -> tuple[StepRecord, ...]:
        """The engine's most recent step records (oldest first), copied on the engine thread."""
        if not self.alive or limit <= 0 or self._loop is None:
            return ()
        snapshot = _StepsSnapshot(limit, asyncio.get_running_loop().create_future())
        self._commands.put(snapshot)
        return await snapshot.result

    def abort(self, request_id: str) -> None:
        tracked = self._tracked.get(request_id)
        if tracked is not None and not tracked.finished:
            self._commands.put(_Abort(request_id))

    def abort_all(self) -> None:
        for request_id in list(self._tracked):
            self.abort(request_id)

    # ---- delivery (event loop, called from the engine thread) ----------------------------------
    def _deliver(self, outputs: list[RequestOutput], now: float) -> None:
        metrics = self.metrics
        for output in outputs:
            tracked = self._tracked.get(output.request_id)
            if metrics is not None:
                metrics.record_output(output, tracked.last_token_time if tracked else None, now)
            if tracked is None:
                continue
            if output.new_token_ids:
                tracked.last_token_time = now
            if output.finished:
                tracked.finished = True
                del self._tracked[output.request_id]
                if metrics is not None:
                    self._finish_in_group(metrics, tracked.group, output)
            tracked.output_queue.put_nowait(output)

    @staticmethod
    def _finish_in_group(metrics: ServerMetrics, group: _Group, output: RequestOutput) -> None:
        group.unfinished -= 1
        group.max_generation_tokens = max(group.max_generation_tokens, output.num_output_tokens)
        if group.unfinished == 0:
            metrics.record_request(group.n, group.max_tokens or output.num_output_tokens,
                                   group.max_generation_tokens)

    def _settle(self, accepted: list[tuple[str, dict[str, dict[str, int]]]],
                rejected: list[tuple[str, BaseException]]) -> None:
        for request_id, degradations in accepted:
            tracked = self._tracked.get(request_id)
            if tracked is not None and not tracked.accepted.done():
                tracked.accepted.set_result(degradations)
        for request_id, error in rejected:
            tracked = self._tracked.pop(request_id, None)
            if tracked is not None and not tracked.accepted.done():
                tracked.accepted.set_exception(error)

    def _fail(self, request_ids: list[str] | None, error: BaseException) -> None:
        """Fail the given requests (None: all) with `error`."""
        for request_id in list(self._tracked) if request_ids is None else request_ids:
            tracked = self._tracked.pop(request_id, None)
            if tracked is None:
                continue
            tracked.finished = True
            if not tracked.accepted.done():
                tracked.accepted.set_exception(error)
            else:
                tracked.output_queue.put_nowait(error)

    def _loaded(self) -> None:
        self.ready_time = time.time()
        self.ready.set()

    def _exited(self, error: BaseException | None) -> None:
        if error is not None:
            self.error = error
            self._fail(None, EngineFailed(f"the engine stopped: {error}"))
        self.done.set()

    # ---- the engine thread ---------------------------------------------------------------------
    def _post(self, callback: Callable[..., None], *args: object) -> None:
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(callback, *args)
        except RuntimeError:
            pass  # the loop is closed: the process is exiting

    def _run(self) -> None:
        try:
            started = time.perf_counter()
            engine = self._factory()
            engine.admission.bound_queue_by_kv_pool(engine.block_manager.num_tokens)
            self.load_seconds = time.perf_counter() - started
            self.metrics = self._metrics_factory(engine)
            if self._warmup:
                started = time.perf_counter()
                engine.warmup()
                self.warmup_seconds = time.perf_counter() - started
            self.info = engine.info
        except BaseException as error:
            logger.exception("the engine failed to start")
            self._post(self._exited, error)
            return
        self._post(self._loaded)
        try:
            self._loop_forever(engine, self.metrics)
        except BaseException as error:
            logger.exception("the engine thread died")
            self._post(self._exited, error)
            return
        self._post(self._exited, None)

    def _loop_forever(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        while True:
            idle = not engine.has_unfinished_requests()
            if idle and self._commands.empty():
                engine.gc_monitor.collect_if_idle_and_due()
            if not self._take_commands(engine, block=idle):
                engine.abort_all()
                return
            if engine.has_unfinished_requests():
                self._step(engine, metrics)
            metrics.record_stats(engine.stats())

    def _take_commands(self, engine: LLMEngine, block: bool) -> bool:
        """Apply every queued command; False once asked to stop. Blocks for the first one if idle."""
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        accepted: list[tuple[str, dict[str, dict[str, int]]]] = []
        rejected: list[tuple[str, BaseException]] = []
        aborted: list[RequestOutput] = []
        keep_running = True
        for command in commands:
            if command is _STOP:
                keep_running = False
            elif isinstance(command, _StepsSnapshot):
                self._post(_resolve, command.result, tuple(engine.steps)[-command.limit:])
            elif isinstance(command, _Abort):
                output = engine.abort(command.request_id)
                if output is not None:
                    aborted.append(output)
            elif isinstance(command, EngineRequest):
                try:
                    seq = engine.add_request(command.prompt_token_ids, command.sampling_params, command.request_id,
                                             command.priority, command.arrival_time, command.cache_salt)
                    for kind in seq.degradations:
                        self.metrics.record_degradation(kind)
                    accepted.append((command.request_id, dict(seq.degradations)))
                except ValueError as error:  # RequestRejectedError, InvalidParameterError, duplicate id
                    rejected.append((command.request_id, RequestRejected(str(error), getattr(error, "param", None))))
                except AdmissionRejectedError as error:  # overloaded: the client may retry later
                    self.metrics.record_admission_rejection(error.reason)
                    rejected.append((command.request_id, error))
        if accepted or rejected:
            self._post(self._settle, accepted, rejected)
        if aborted:
            self._post(self._deliver, aborted, time.monotonic())
        return keep_running

    def _step(self, engine: LLMEngine, metrics: ServerMetrics) -> None:
        last_record = engine.steps[-1] if engine.steps else None
        started = time.monotonic()
        try:
            outputs = engine.step()
        except Exception as error:
            # Fail the requests of this step rather than the server: free them and report a 500.
            failed = list(engine.requests)
            logger.exception("engine step failed; aborting %d requests", len(failed))
            engine.abort_all()
            self._post(self._fail, failed, EngineFailed(f"engine step failed: {error!r}"))
            return
        finished = time.monotonic()
        record = engine.steps[-1] if engine.steps else None
        metrics.record_step(finished - started, record.num_tokens if record is not last_record else 0)
        if outputs:
            self._post(self._deliver, outputs, finished)


def _resolve(future: asyncio.Future[tuple[StepRecord, ...]], value: tuple[StepRecord, ...]) -> None:
    if not future.done():
        future.set_result(value)


def metrics_factory(prefix: str = "titan") -> Callable[[LLMEngine], ServerMetrics]:
    """Builds the server's metrics once the engine is loaded (`--metrics-prefix`)."""

    def build(engine: LLMEngine) -> ServerMetrics:
        cache = engine.config.cache
        cache_info = {"block_size": str(cache.block_size), "num_gpu_blocks": str(engine.num_blocks),
                      "enable_prefix_caching": str(cache.enable_prefix_caching),
                      "cache_dtype": str(engine.kv_cache_dtype).removeprefix("torch."), "device": str(engine.device)}
        metrics = ServerMetrics(engine.model_name, engine.max_model_len,
                                engine.config.scheduler.max_num_batched_tokens, prefix, cache_info)
        engine.gc_monitor.listeners.append(metrics.record_gc_pause)
        return metrics

    return build


def default_metrics(engine: LLMEngine) -> ServerMetrics:
    return metrics_factory()(engine)
