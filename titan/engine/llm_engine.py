"""The engine: requests in, one scheduled step at a time, request outputs out."""

from __future__ import annotations

import json
import logging
import time
from collections import deque
from dataclasses import dataclass

import torch

from titan.config import EngineConfig
from titan.engine.admission import AdmissionController
from titan.engine.block_manager import BlockManager
from titan.engine.cost_model import StepCostModel, shape_of
from titan.engine.gc_discipline import GcMonitor
from titan.engine.model_runner import ModelRunner
from titan.engine.outputs import OutputProcessor, RequestOutput
from titan.engine.sampler import Sampler
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler import Scheduler
from titan.engine.scheduler_output import SchedulerOutput
from titan.engine.sequence import Sequence, SequenceStatus
from titan.kernels.threads import configure_threads
from titan.loader import load_model_files
from titan.tokenizer import Tokenizer

logger = logging.getLogger("titan.engine")

STEP_HISTORY = 2048  # engine steps kept for attribution (/debug/steps)


@dataclass(frozen=True)
class StepRecord:
    """One engine step, for transient attribution."""

    started: float  # time.monotonic()
    duration: float
    num_tokens: int
    num_sequences: int
    num_prefill_tokens: int  # tokens of sequences computing more than one token
    num_decodes: int
    num_preemptions: int
    predicted_duration: float | None  # the cost model's prediction, once it is fitted
    gc_pause: float  # seconds the garbage collector paused during the step

    @classmethod
    def of(cls, output: SchedulerOutput, started: float, duration: float, predicted: float | None,
           gc_pause: float) -> StepRecord:
        prefill_tokens = sum(s.num_new_tokens for s in output.scheduled if s.num_new_tokens > 1)
        return cls(started, duration, output.num_batched_tokens, len(output.scheduled), prefill_tokens,
                   sum(1 for s in output.scheduled if s.num_new_tokens == 1), len(output.preempted_seq_ids),
                   predicted, gc_pause)


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: gauges now, counters since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int

# On CPU the cache is ordinary RAM shared with everything else; 1 GiB holds ~23k tokens of the
# default model, far more than two cores can keep busy.
DEFAULT_CPU_KV_CACHE_GIB = 1.0
# On CUDA take this share of the memory left after the weights (like vLLM's gpu_memory_utilization).
CUDA_KV_CACHE_FRACTION = 0.8


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for, but torch sees no CUDA device")
    if dtype == "auto":
        if device == "cpu":
            dtype = "float32"
        else:
            dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    return torch.device(device), getattr(torch, dtype)


def kv_cache_blocks(
    config: EngineConfig, bytes_per_block: int, device: torch.device, max_model_len: int
) -> int:
    """Blocks in the KV pool: from --kv-cache-memory, else an automatic share of the device."""
    if config.cache.kv_cache_memory_gib is not None:
        budget = config.cache.kv_cache_memory_gib * 2**30
    elif device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = free * CUDA_KV_CACHE_FRACTION
    else:
        # Never more than every sequence at full length could use.
        useful = config.scheduler.max_num_seqs * max_model_len * (bytes_per_block / config.cache.block_size)
        budget = min(DEFAULT_CPU_KV_CACHE_GIB * 2**30, useful)
    num_blocks = int(budget // bytes_per_block)
    if num_blocks < 2:
        raise ValueError(f"--kv-cache-memory is too small: it holds {num_blocks} blocks")
    return num_blocks


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        configure_threads(config.threads)
        files = load_model_files(config.model, config.quantization)
        self.model_name = files.name
        self.model_config = files.config
        self.tokenizer = Tokenizer.from_folder(files.folder)
        self.device, self.dtype = resolve_device(config.device, config.dtype)
        self.max_model_len = config.max_model_len or files.config.max_position_embeddings
        block_size = config.cache.block_size
        bytes_per_block = ModelRunner.kv_cache_bytes_per_block(files.config, block_size, self.dtype)
        self.num_blocks = kv_cache_blocks(config, bytes_per_block, self.device, self.max_model_len)
        self.block_manager = BlockManager(self.num_blocks, block_size, config.cache.enable_prefix_caching)
        eos = self.tokenizer.eos_token_ids
        # Fitted online to every step; the slo policy caps prefill chunks with it.
        self.cost_model = StepCostModel()
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, eos, self.cost_model)
        self.admission = AdmissionController(config.admission, self.cost_model, config.scheduler)
        self.steps: deque[StepRecord] = deque(maxlen=STEP_HISTORY)
        self.gc_monitor = GcMonitor.install()
        sampler = Sampler(eos, seed=config.seed)
        self.runner = ModelRunner(files.config, files.weights, self.num_blocks, block_size, self.device,
                                  self.dtype, sampler)
        self.output_processor = OutputProcessor(self.tokenizer, self.scheduler)
        self.requests: dict[str, Sequence] = {}
        self.load_seconds = time.perf_counter() - started
        logger.info("loaded %s on %s/%s in %.2f s: %d KV blocks of %d tokens, max_model_len %d",
                    self.model_name, self.device, self.dtype, self.load_seconds, self.num_blocks, block_size,
                    self.max_model_len)

    def warmup(self) -> None:
        """Drive the largest shapes once, then settle the garbage collector (see gc_discipline)."""
        self.runner.warmup(self.config.scheduler.max_num_batched_tokens, self.config.scheduler.max_num_seqs)
        self.gc_monitor.settle_after_warmup()

    def add_request(
        self,
        prompt: str | list[int],
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> Sequence:
        """Queue a request; raises RequestRejectedError if it can never fit, AdmissionRejectedError if the
        server is too loaded to start it in time. `arrival_time` (time.monotonic()) defaults to now."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        seq = Sequence(token_ids, sampling_params or SamplingParams(), request_id, priority, arrival_time)
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.scheduler.check_admissible(seq)
        waiting = list(self.scheduler.waiting)
        self.admission.check(seq, waiting, self.scheduler.running, self.scheduler.ahead_of(seq))
        self.admission.degrade(seq, waiting, self.scheduler.max_length(seq) - seq.num_prompt_tokens)
        self.scheduler.add(seq)
        self.output_processor.add(seq)
        self.requests[seq.request_id] = seq
        return seq

    def step(self) -> list[RequestOutput]:
        started = time.monotonic()
        gc_before = self.gc_monitor.total_pause_seconds
        scheduler_output = self.scheduler.schedule()
        shape = shape_of(scheduler_output.scheduled)
        predicted = self.cost_model.predict(shape) if self.cost_model.ready else None
        runner_output = self.runner.execute(scheduler_output)
        duration = time.monotonic() - started
        if not scheduler_output.is_empty:
            self.cost_model.observe(shape, duration)
            gc_pause = self.gc_monitor.total_pause_seconds - gc_before
            self.steps.append(StepRecord.of(scheduler_output, started, duration, predicted, gc_pause))
            self._record_prefill_chunks(scheduler_output, started, duration)
        advanced = self.scheduler.update(scheduler_output, runner_output)
        now = time.monotonic()
        for seq in advanced:
            seq.timeline.record_token(now, seq.num_preemptions, reversed(self.steps))
        outputs = self.output_processor.process(advanced, runner_output)
        for output in outputs:
            if output.finished:
                self._finished(self.requests.pop(output.request_id, None), output)
        return outputs

    def _record_prefill_chunks(self, output: SchedulerOutput, started: float, duration: float) -> None:
        for scheduled in output.scheduled:
            seq = self.scheduler.sequences.get(scheduled.seq_id)
            if seq is not None and (scheduled.start_position < seq.num_prompt_tokens or scheduled.num_new_tokens > 1):
                seq.timeline.record_chunk(started, scheduled.num_new_tokens, duration, seq.num_preemptions > 0)

    def _finished(self, seq: Sequence | None, output: RequestOutput) -> None:
        """Log a request whose first token or longest stall took longer than `slow_request_ms`."""
        threshold = self.config.slow_request_ms
        if seq is None or not threshold or output.timeline is None:
            return
        stall = output.timeline["longest_stall"]
        ttft = output.timeline["ttft_ms"] or 0.0
        if ttft > threshold or (stall is not None and stall["ms"] > threshold):
            logger.warning("slow request %s: %s", seq.request_id, json.dumps(output.timeline, separators=(",", ":")))

    def abort(self, request_id: str) -> RequestOutput | None:
        """Stop a request now and free its KV blocks; returns its final output."""
        seq = self.requests.pop(request_id, None)
        if seq is None or seq.is_finished:
            return None
        self.scheduler.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return self.output_processor.aborted(seq)

    def stats(self) -> EngineStats:
        manager = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=manager.usage,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished
