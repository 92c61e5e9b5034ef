"""Typed configuration, validated at construction, written once: each tunable field carries its help
text (and, where it differs from the field name, its flag name) as metadata, and `titan.config_flags`
derives the command-line flags and `LLM(...)` keyword arguments from it."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


def option(default: Any, help: str, flag: str | None = None, choices: tuple[str, ...] | None = None,
           parse: Any = None) -> Any:
    """A config field that is also a flag `--{flag or field name}` and an `LLM(...)` keyword; `parse` turns
    the flag's text into the field's value where its type alone cannot (JSON, "auto" or a number)."""
    return field(default=default, metadata={"help": help, "flag": flag, "choices": choices, "parse": parse})


def number_or_auto(text: str) -> float | str:
    return "auto" if text == "auto" else float(text)

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


@dataclass(frozen=True)
class ModelConfig:
    """Architecture hyperparameters of a Llama-family decoder (HF `config.json` names)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ValueError(f"unsupported architecture {self.architecture!r}; supported: {supported}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive")

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build from a parsed HF `config.json`."""
        architectures = hf.get("architectures") or ["LlamaForCausalLM"]
        num_heads = hf["num_attention_heads"]
        rope_scaling = hf.get("rope_scaling")
        rope_theta = hf.get("rope_theta")
        # transformers >= 5 nests rope settings under `rope_parameters`.
        rope_parameters = hf.get("rope_parameters")
        if rope_parameters:
            rope_theta = rope_theta or rope_parameters.get("rope_theta")
            if rope_parameters.get("rope_type", "default") != "default":
                rope_scaling = rope_scaling or dict(rope_parameters)
        if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "default":
            rope_scaling = None
        architecture = architectures[0]
        return cls(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=num_heads,
            num_key_value_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta or 10000.0),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", architecture == "Qwen2ForCausalLM")),
            rope_scaling=rope_scaling,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of `from_hf_config` (used to write converted GGUF models)."""
        config: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": {"Qwen2ForCausalLM": "qwen2", "MistralForCausalLM": "mistral"}.get(
                self.architecture, "llama"
            ),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
        }
        if self.rope_scaling:
            config["rope_scaling"] = self.rope_scaling
        return config


KV_CACHE_DTYPES = ("auto", "float32", "float16", "bfloat16")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: `num_blocks` blocks of `block_size` tokens each."""

    block_size: int = option(16, "tokens per KV cache block")
    kv_cache_memory_gib: float | None = option(
        None, "KV cache size in GiB (default: 1 GiB on CPU, 80%% of free memory on CUDA)", flag="kv_cache_memory")
    enable_prefix_caching: bool = option(True, "reuse the KV cache of shared prompt prefixes")
    kv_cache_dtype: str = option(
        "auto", "KV cache element type (auto: float16 on CPU, the model's dtype on CUDA)", choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, not {self.kv_cache_dtype!r}")
        if self.block_size <= 0:
            raise ValueError("block_size must be positive")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError("kv_cache_memory_gib must be positive")


SCHEDULING_POLICIES = ("fcfs", "priority", "slo")
# The slo policy's step target when none is given: derived online, this many times the predicted
# duration of the step's decodes alone, so it follows the machine, the model, its kernels and the batch
# width. A capped prefill chunk adds at most half the decodes' own step: the token gap stays within 2x the
# typical one with room for prediction error and a batch that grew.
DEFAULT_SLO_ITL_MS = "auto"
AUTO_ITL_FACTOR = 1.5
# The slo policy's TTFT target when none is given: this many times the request's whole prompt's predicted
# prefill alone (serving benchmarks set TTFT SLOs at 5-10x the unloaded TTFT), so it follows the machine,
# the model and the prompt's length.
AUTO_TTFT_FACTOR = 10.0


@dataclass(frozen=True)
class SchedulerConfig:
    """Iteration-level batching limits and the scheduling policy.

    slo is the default: it met the throughput rule of `benchmarks/default_policy.py` (burst output tok/s
    >= 0.9x fcfs's, TTFT P99 <= 1.1x) in two full runs on two machines. fcfs: arrival order (vLLM's
    default). priority: lower `priority` runs first; a waiting request may preempt lower-priority running
    ones, also when `max_num_seqs` is the limit; waiting requests gain one priority level per
    `aging_seconds` so none starves. slo: priority, plus prefill chunks capped
    so that each step's predicted duration stays within `itl_slo_ms` (in steps that carry decodes;
    auto unless given: AUTO_ITL_FACTOR x the step's decodes alone), and within a priority level the
    prefill with the earliest deadline (arrival + AUTO_TTFT_FACTOR x the predicted prefill alone of what
    it computes: its auto TTFT target) goes first. Under a backlog (at the cap some queued request would
    miss `ttft_target_ms`) slo lets steps run to `max_itl_excursion` x that target, but not past
    `max_drain_step_factor` x the typical decodes' own step, or as far as keeping pace with the arrivals
    takes but never past the full batch's step (`max_num_seqs` decodes and their slots' refill:
    titan.engine.overload), until the queue is on time again with half its targets to spare
    (titan.engine.prefill_budget states the rule); the cap widens
    to keep pace with the prompt tokens arriving over `prefill_demand_window_s` (titan.engine.prefill_demand).
    """

    max_num_batched_tokens: int = option(512, "token budget per step")
    max_num_seqs: int = option(64, "sequences per step")
    policy: str = option("slo", "fcfs: arrival order (vLLM's default); priority: lower `priority` first, with "
                         "preemption; slo (the default): priority plus prefill chunks capped to keep steps within "
                         "--itl-slo-ms (auto), draining backlogs at --max-itl-excursion",
                         flag="scheduling_policy", choices=SCHEDULING_POLICIES)
    aging_seconds: float = option(10.0, "a waiting request gains one priority level per this many seconds (0: off)")
    itl_slo_ms: float | str | None = option(
        None, "target step duration in ms for --scheduling-policy slo, or auto (its default): "
              f"{AUTO_ITL_FACTOR:g}x the predicted duration of the step's decodes alone", parse=number_or_auto)
    min_prefill_chunk: int = option(1, "even under the slo cap, the first prefill of a step computes this many "
                                       "tokens (1: the cap decides, a prefill still moves every step)")
    ttft_target_ms: float | str = option(
        "auto", "the slo policy's time-to-first-token target in ms for its goodput rule, or auto: "
                f"{AUTO_TTFT_FACTOR:g}x the predicted prefill of the request's prompt alone", parse=number_or_auto)
    max_itl_excursion: float = option(
        10.0, "under a backlog (at the ITL cap a queued request would miss its TTFT target) the slo policy "
             "lets steps run to this many times their ITL target until the queue is on time again (1: never)")
    max_drain_step_factor: float = option(
        2.0, "slo: a backlog drain's excursion (--max-itl-excursion) is at most this many times the typical recent "
             "decodes' own step; keeping pace with the arriving prompts is not bounded by it (0: no such bound)")
    prefill_demand_window_s: float = option(
        10.0, "the slo cap keeps pace with the prompt tokens that arrived over this many seconds, so steady "
              "traffic never builds a backlog (0: the ITL target alone sizes the cap)")
    batch_min_requests: int = option(
        4, "slo: a queue holding this many requests that arrived together (within 100 ms of the first: a "
           "fan-out, an eval job, a burst; more under heavy traffic, where smaller clusters come by chance) is "
           "prefilled at the whole token budget, as fcfs would (0: never)")

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_batched_tokens must be positive")
        if self.max_num_seqs <= 0:
            raise ValueError("max_num_seqs must be positive")
        if self.policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)}, not {self.policy!r}")
        if self.aging_seconds < 0:
            raise ValueError("aging_seconds must be non-negative (0 disables aging)")
        if isinstance(self.itl_slo_ms, str) and self.itl_slo_ms != "auto":
            raise ValueError(f"itl_slo_ms must be a number of milliseconds or auto, not {self.itl_slo_ms!r}")
        if isinstance(self.itl_slo_ms, int | float) and self.itl_slo_ms <= 0:
            raise ValueError("itl_slo_ms must be positive")
        if self.policy == "slo" and self.itl_slo_ms is None:
            object.__setattr__(self, "itl_slo_ms", DEFAULT_SLO_ITL_MS)
        if self.min_prefill_chunk <= 0:
            raise ValueError("min_prefill_chunk must be positive")
        if isinstance(self.ttft_target_ms, str) and self.ttft_target_ms != "auto":
            raise ValueError(f"ttft_target_ms must be a number of milliseconds or auto, not {self.ttft_target_ms!r}")
        if isinstance(self.ttft_target_ms, int | float) and self.ttft_target_ms <= 0:
            raise ValueError("ttft_target_ms must be positive")
        if self.batch_min_requests < 0:
            raise ValueError("batch_min_requests must be non-negative (0: never)")
        if self.max_itl_excursion < 1.0:
            raise ValueError("max_itl_excursion must be at least 1 (1: never exceed the ITL target)")
        if self.max_drain_step_factor != 0 and self.max_drain_step_factor < 1.0:
            raise ValueError("max_drain_step_factor must be 0 (no bound) or at least 1")
        if self.prefill_demand_window_s < 0:
            raise ValueError("prefill_demand_window_s must be non-negative (0: no pacing)")


@dataclass(frozen=True)
class AdmissionConfig:
    """Admission control (see titan.engine.admission). Queue limits left at None are derived from the KV
    pool (see `AdmissionController`); 0 disables one."""

    max_queued_requests: int | None = option(
        None, "bound on waiting sequences (default: derived from the KV pool; 0: unbounded)")
    max_queued_tokens: int | None = option(
        None, "bound on waiting prompt tokens (default: derived from the KV pool; 0: unbounded)")
    ttft_slo_ms: float | None = option(None, "refuse requests whose predicted time to first token exceeds this")
    batch_share: float = option(0.5, "share of each admission limit the batch class (priority > 0) may use")
    degrade_batch_max_tokens: int | None = option(
        None, "opt-in: while requests are waiting, clamp batch-class max_tokens to this (counted, and reported "
              "in the response as titan_degraded)")
    admit_long_prompts: bool = option(
        False, "with --ttft-slo-ms, judge a prompt whose own prefill exceeds half the target only by the wait "
               "ahead of it (it may then miss the target)")

    def __post_init__(self) -> None:
        for name in ("max_queued_requests", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ValueError(f"{name} must be non-negative (0: unbounded)")
        if self.ttft_slo_ms is not None and self.ttft_slo_ms <= 0:
            raise ValueError("ttft_slo_ms must be positive")
        if not 0.0 < self.batch_share <= 1.0:
            raise ValueError("batch_share must be in (0, 1]")
        if self.degrade_batch_max_tokens is not None and self.degrade_batch_max_tokens < 1:
            raise ValueError("degrade_batch_max_tokens must be at least 1")


QUANTIZATION_CHOICES = ("auto", "none", "int8", "int4")
SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
                    "adaptive")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's `--speculative-config` keys). ngram: drafts continue the latest earlier
    occurrence of the sequence's last `prompt_lookup_max`..`prompt_lookup_min` tokens; draft_model: a smaller
    model with the same vocabulary drafts greedily. adaptive: each step verifies only the drafts the cost
    model predicts to pay off (see titan.engine.spec.planner); false pins `num_speculative_tokens`."""

    method: str
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    model: str | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}, not {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            if not isinstance(getattr(self, name), int) or isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be an integer")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError("num_speculative_tokens must be between 1 and 16")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max")
        if self.method == "draft_model" and not self.model:
            raise ValueError('speculative method draft_model needs "model": a path, or "default"')
        if not isinstance(self.adaptive, bool):
            raise ValueError("adaptive must be true or false")

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the flag's JSON text or an `LLM(speculative_config={...})` dict; unknown keys are an error."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"speculative_config is not valid JSON: {error}") from error
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        unknown = sorted(set(value) - set(SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(f"unknown speculative_config key(s): {', '.join(unknown)}; known: "
                             f"{', '.join(SPECULATIVE_KEYS)}")
        if "method" not in value:
            raise ValueError('speculative_config needs "method": ngram or draft_model')
        return cls(**value)


@dataclass(frozen=True)
class EngineConfig:
    """Everything an engine needs; `model` is 'default', a GGUF file or an HF folder."""

    model: str = option("default", "'default' (SmolLM2-135M-Instruct Q4_1), a .gguf file or an HF folder")
    device: str = option("auto", "where the model runs", choices=("auto", "cpu", "cuda"))
    dtype: str = option("auto", "auto: float32 on CPU, bfloat16 (or float16) on CUDA",
                        choices=("auto", "float32", "bfloat16", "float16"))
    max_model_len: int | None = option(None, "context length (default: the model's)")
    seed: int = option(0, "seed for requests without their own")
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    slow_request_ms: float = option(
        5000.0, "log the timeline of requests whose first token or longest token gap took longer (0: off)")
    grammar_cache_size: int = option(64, "compiled structured-output grammars kept for reuse")
    chat_template: str | None = option(None, "a Jinja chat template file used instead of the model's own")
    generation_config: str = option(
        "auto", "sampling defaults for API requests that leave them unset: auto (the model's generation_config.json), "
                "a JSON file, or none")
    quantization: str = option(
        "auto", "auto: a GGUF keeps its block formats (quantized kernels), an HF checkpoint its own GPTQ/AWQ "
                "config; none: dequantize to float at load; int8 / int4: quantize float weights at load",
        choices=QUANTIZATION_CHOICES)
    speculative_config: SpeculativeConfig | None = option(
        None, 'speculative decoding as JSON, e.g. {"method": "ngram", "num_speculative_tokens": 4} or '
              '{"method": "draft_model", "model": "PATH"}; "adaptive": false pins the draft length',
        parse=SpeculativeConfig.parse)
    threads: int | None = option(None, "compute threads for this process (default: OMP_NUM_THREADS if set, else "
                                       "the physical cores it may use); split the cores between replicas on one host")

    def __post_init__(self) -> None:
        if self.speculative_config is not None:
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        if self.quantization not in QUANTIZATION_CHOICES:
            choices = ", ".join(QUANTIZATION_CHOICES)
            raise ValueError(f"quantization must be one of {choices}, not {self.quantization!r}")
        if self.threads is not None and self.threads < 1:
            raise ValueError("threads must be at least 1")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ValueError(f"device must be auto, cpu or cuda, not {self.device!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, not {self.dtype!r}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError("max_model_len must be at least 2")
        if self.generation_config not in ("auto", "none") and not Path(self.generation_config).is_file():
            raise ValueError(f"generation_config: auto, none or a JSON file, not {self.generation_config!r}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat_template: no such file {self.chat_template!r}")
        if self.grammar_cache_size < 1:
            raise ValueError("grammar_cache_size must be at least 1")
        if self.slow_request_ms < 0:
            raise ValueError("slow_request_ms must be non-negative (0: log no slow requests)")
