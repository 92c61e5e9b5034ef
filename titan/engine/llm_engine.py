"""The engine: requests in, one scheduled step at a time, request outputs out."""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from types import MappingProxyType

import torch

from titan.config import EngineConfig
from titan.engine import fault_injection
from titan.engine.admission import AdmissionController
from titan.engine.block_manager import BlockManager
from titan.engine.cost_model import StepCostModel
from titan.engine.gc_discipline import GcMonitor
from titan.engine.model_runner import ModelRunner
from titan.engine.outputs import OutputProcessor, RequestOutput
from titan.engine.sampler import Sampler
from titan.engine.sampling_params import SamplingParams, tokenize_bad_words
from titan.engine.scheduler import Scheduler
from titan.engine.sequence import Sequence, SequenceStatus
from titan.engine.spec.drafter import make_drafter
from titan.engine.spec.planner import SpecStats, SpeculationPlanner
from titan.engine.step_observer import StepDone, StepObserver, StepRecord
from titan.engine.structured import GrammarCompiler
from titan.kernels.threads import configure_threads
from titan.loader import load_model_files
from titan.tokenizer import Tokenizer

logger = logging.getLogger("titan.engine")

@dataclass(frozen=True)
class EngineInfo:
    """What the HTTP side may know of an engine: fixed once it is loaded, safe to read from any thread."""

    model_name: str
    tokenizer: Tokenizer
    vocab_size: int
    max_model_len: int
    grammars: GrammarCompiler  # thread-safe: the server compiles request grammars with it off the engine thread
    # Sampling defaults for API requests that leave a field unset (vLLM's --generation-config rule).
    sampling_defaults: Mapping[str, float] = field(default_factory=dict)
    kv_cache_tokens: int | None = None  # the whole KV cache: what one request can hold, if less than the context


@dataclass(frozen=True)
class EngineStats:
    """A snapshot for metrics: gauges now, counters since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # 0..1
    prefix_cache_queries: int  # tokens
    prefix_cache_hits: int  # tokens
    num_preemptions: int
    spec: SpecStats | None = None  # speculative decoding counters (None: off)

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


def resolve_kv_cache_dtype(kv_cache_dtype: str, device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """auto: float16 on CPU, where the model computes in float32 and decode attention reads the whole cache
    every step (half the bytes; twice the tokens in the same memory; the default model's teacher-forced top-1
    agreement with a float32 cache is 100%, tests/test_quantized_model.py), as llama.cpp's default cache
    type; on CUDA the model's own 16-bit dtype."""
    if kv_cache_dtype != "auto":
        return getattr(torch, kv_cache_dtype)
    return torch.float16 if device.type == "cpu" else dtype


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


# generation_config.json keys that are sampling defaults (the same names as SamplingParams').
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def sampling_defaults(source: str, model_folder: Path) -> dict[str, float]:
    """The sampling defaults `--generation-config` names: auto → the model folder's file, none → none."""
    if source == "none":
        return {}
    path = model_folder / "generation_config.json" if source == "auto" else Path(source)
    if not path.is_file():
        return {}
    values = json.loads(path.read_text())
    return {key: values[key] for key in SAMPLING_DEFAULT_KEYS if isinstance(values.get(key), int | float)}


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        started = time.perf_counter()
        self.config = config
        configure_threads(config.threads)
        files = load_model_files(config.model, config.quantization)
        self.model_name = files.name
        self.model_config = files.config
        self.tokenizer = Tokenizer.from_folder(files.folder)
        if config.chat_template is not None:
            self.tokenizer.chat_template = Path(config.chat_template).read_text()
        self.sampling_defaults = sampling_defaults(config.generation_config, files.folder)
        self.device, self.dtype = resolve_device(config.device, config.dtype)
        self.max_model_len = config.max_model_len or files.config.max_position_embeddings
        block_size = config.cache.block_size
        self.kv_cache_dtype = resolve_kv_cache_dtype(config.cache.kv_cache_dtype, self.device, self.dtype)
        bytes_per_block = ModelRunner.kv_cache_bytes_per_block(files.config, block_size, self.kv_cache_dtype)
        self.num_blocks = kv_cache_blocks(config, bytes_per_block, self.device, self.max_model_len)
        self.block_manager = BlockManager(self.num_blocks, block_size, config.cache.enable_prefix_caching)
        eos = self.tokenizer.eos_token_ids
        # Fitted online to every step; the slo policy caps prefill chunks with it.
        self.cost_model = StepCostModel()
        spec = config.speculative_config
        self.speculation = SpeculationPlanner(spec) if spec is not None else None
        self.scheduler = Scheduler(config.scheduler, self.block_manager, self.max_model_len, eos, self.cost_model,
                                   self.speculation)
        self.admission = AdmissionController(config.admission, self.cost_model, config.scheduler)
        self.gc_monitor = GcMonitor.install()
        self.observer = StepObserver(self.cost_model, self.gc_monitor, self.speculation)
        sampler = Sampler(eos, seed=config.seed)
        self.step_faults = fault_injection.from_environment()
        self.runner = ModelRunner(files.config, files.weights, self.num_blocks, block_size, self.device,
                                  self.dtype, sampler, self.kv_cache_dtype)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.drafter = make_drafter(spec, self) if spec is not None else None
        self.requests: dict[str, Sequence] = {}
        self.grammars = GrammarCompiler(self.tokenizer, files.config.vocab_size, config.grammar_cache_size)
        self.load_seconds = time.perf_counter() - started
        logger.info("loaded %s on %s/%s in %.2f s: %d KV blocks of %d tokens (%s), max_model_len %d",
                    self.model_name, self.device, self.dtype, self.load_seconds, self.num_blocks, block_size,
                    str(self.kv_cache_dtype).removeprefix("torch."), self.max_model_len)

    @property
    def info(self) -> EngineInfo:
        return EngineInfo(self.model_name, self.tokenizer, self.model_config.vocab_size, self.max_model_len,
                          self.grammars, MappingProxyType(self.sampling_defaults),
                          self.block_manager.num_tokens)

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
        cache_salt: str | None = None,
    ) -> Sequence:
        """Queue a request; raises RequestRejectedError if it can never fit, AdmissionRejectedError if the
        server is too loaded to start it in time. `arrival_time` (time.monotonic()) defaults to now; only
        requests with the same `cache_salt` share prefix-cache blocks."""
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        params = sampling_params or SamplingParams()
        if params.bad_words and params.bad_words_token_ids is None:  # offline: the server tokenized them already
            encode = functools.partial(self.tokenizer.encode, add_special_tokens=False)
            params = dataclasses.replace(params, bad_words_token_ids=tokenize_bad_words(params.bad_words, encode))
        seq = Sequence(token_ids, params, request_id, priority, arrival_time, cache_salt)
        if seq.request_id in self.requests:
            raise ValueError(f"request id {seq.request_id!r} is already in use")
        self.scheduler.check_admissible(seq)
        if seq.sampling_params.structured_outputs is not None:  # a cache hit when the server compiled it
            seq.grammar = self.grammars.new_state(seq.sampling_params.structured_outputs)
        waiting = list(self.scheduler.waiting)
        self.admission.check(seq, waiting, self.scheduler.running, self.scheduler.ahead_of(seq))
        self.admission.degrade(seq, waiting, self.scheduler.max_length(seq) - seq.num_prompt_tokens)
        self.scheduler.add(seq)
        self.output_processor.add(seq)
        self.requests[seq.request_id] = seq
        return seq

    def step(self) -> list[RequestOutput]:
        """One step, one way: the scheduler decides, the runner computes, commit publishes, emit reports."""
        started, gc_pause_before = time.monotonic(), self.gc_monitor.total_pause_seconds
        decision = self.scheduler.schedule()
        scheduled_seqs = [self.scheduler.sequences.get(s.seq_id) for s in decision.scheduled]
        self.step_faults.check(bool(decision.scheduled))  # test-only; off unless TITAN_TEST_FAIL_STEP_EVERY
        result = self.runner.execute(decision)
        duration = time.monotonic() - started
        advanced = self.scheduler.commit(decision, result)
        detokenized = self.output_processor.detokenize(advanced)
        self.scheduler.stop(detokenized.stopped)
        if self.drafter is not None:
            self.drafter.propose(self.scheduler.running)
        self.observer.observe(StepDone(decision, result, scheduled_seqs, advanced, started, duration,
                                       gc_pause_before))
        outputs = self.output_processor.emit(detokenized)
        for output in outputs:
            if output.finished:
                self._finished(self.requests.pop(output.request_id, None), output)
        return outputs

    @property
    def steps(self) -> deque[StepRecord]:
        return self.observer.steps

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

    def abort_all(self) -> list[RequestOutput]:
        """The step-failure path: end every request and free its blocks. Nothing of the failed step was
        committed, so the prefix cache holds no block it may have left half written."""
        outputs = [self.abort(request_id) for request_id in list(self.requests)]
        return [output for output in outputs if output is not None]

    def stats(self) -> EngineStats:
        manager = self.block_manager
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=manager.usage,
            prefix_cache_queries=manager.prefix_cache_queries,
            prefix_cache_hits=manager.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            spec=None if self.speculation is None else replace(self.speculation.stats,
                accepted_per_position=list(self.speculation.stats.accepted_per_position)),
        )

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished
