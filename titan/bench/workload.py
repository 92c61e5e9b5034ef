"""What to send: synthetic or JSONL prompts, scenario presets, request classes and token counting.

Every request is derived from (seed, index) alone, so a sweep replays the same prompts at each rate and a
run can be repeated exactly. Nothing here talks to the network.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

# The usual rule of thumb for English text under BPE tokenizers; only used without --tokenizer.
CHARS_PER_TOKEN = 4.0

# Filler vocabulary for synthetic prompts: common words that are one token each (with their leading space)
# in the usual large BPE vocabularies (GPT-2 style, Llama 3, Qwen, SmolLM), so N words make ~N tokens even
# without --tokenizer.
WORDS = (
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health "
    "person art war history party result change morning reason research girl guy moment air teacher force "
    "education river light green small large early young important public bad same able open close simple "
    "run walk read write think know make take see come give find tell ask feel try leave call keep begin"
).split()


@dataclass(frozen=True)
class LengthDistribution:
    """Token counts: `N` (fixed), `LO:HI` (uniform, inclusive) or `exp:MEAN` (exponential, clamped)."""

    kind: str
    low: int
    high: int

    @classmethod
    def fixed(cls, value: int) -> LengthDistribution:
        return cls("fixed", value, value)

    @classmethod
    def parse(cls, text: str) -> LengthDistribution:
        text = text.strip()
        try:
            if text.startswith("exp:"):
                mean = int(text[4:])
                # Clamped at 8x the mean: a single 100x outlier would dominate a short run.
                result = cls("exponential", max(mean, 1), max(mean, 1) * 8)
            elif ":" in text:
                low, high = (int(part) for part in text.split(":", 1))
                result = cls("uniform", low, high)
            else:
                result = cls.fixed(int(text))
        except ValueError as error:
            raise ValueError(f"bad length {text!r}: use N, LO:HI or exp:MEAN") from error
        if result.low < 1 or result.high < result.low:
            raise ValueError(f"bad length {text!r}: lengths must be >= 1 and LO <= HI")
        return result

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return self.low
        if self.kind == "uniform":
            return rng.randint(self.low, self.high)
        return min(self.high, max(1, round(rng.expovariate(1.0 / self.low))))

    @property
    def mean(self) -> float:
        if self.kind == "exponential":
            return float(self.low)
        return (self.low + self.high) / 2

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(self.low)
        if self.kind == "uniform":
            return f"{self.low}:{self.high}"
        return f"exp:{self.low}"


class TokenCounter:
    """Counts tokens with the served model's tokenizer.json when given, else estimates from characters."""

    def __init__(self, tokenizer_path: str | None = None) -> None:
        self.tokenizer: Any = None
        self.path = tokenizer_path
        if tokenizer_path is not None:
            from tokenizers import Tokenizer  # light (Rust extension), and only when asked for

            self.tokenizer = Tokenizer.from_file(str(tokenizer_path))

    @property
    def exact(self) -> bool:
        return self.tokenizer is not None

    def count(self, text: str) -> int:
        if self.tokenizer is not None:
            return len(self.tokenizer.encode(text, add_special_tokens=False).ids)
        return max(1, round(len(text) / CHARS_PER_TOKEN)) if text else 0

    def count_filler(self, text: str) -> int:
        """Tokens in text from `make_text`: exact with a tokenizer, else one per filler word."""
        return self.count(text) if self.tokenizer is not None else len(text.split())

    def make_text(self, rng: random.Random, num_tokens: int) -> str:
        """Random filler text of `num_tokens` tokens (exactly, up to re-tokenization, with a tokenizer)."""
        words = [rng.choice(WORDS) for _ in range(num_tokens + (8 if self.tokenizer is not None else 0))]
        if self.tokenizer is None:
            return " ".join(words)
        ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False).ids
        while len(ids) < num_tokens:  # only for tokenizers that merge whole word pairs
            words.extend(rng.choice(WORDS) for _ in range(num_tokens))
            ids = self.tokenizer.encode(" ".join(words), add_special_tokens=False).ids
        return self.tokenizer.decode(ids[:num_tokens])


@dataclass(frozen=True)
class RequestClass:
    """One kind of traffic in a scenario; `weight` is its share of requests."""

    name: str
    weight: float
    input_len: LengthDistribution
    output_len: LengthDistribution
    priority: int | None = None


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    request_rate: float
    classes: tuple[RequestClass, ...]
    prefix_len: int = 0  # shared prefix tokens (shared-prefix)
    burst_size: int = 0  # requests per burst (burst)
    burst_interval: float = 0.0  # seconds between bursts (burst)


def _fixed(value: int) -> LengthDistribution:
    return LengthDistribution.fixed(value)


PRESETS: dict[str, Preset] = {
    preset.name: preset
    for preset in (
        Preset("steady", "Poisson arrivals of one request shape", 2.0,
               (RequestClass("default", 1.0, _fixed(256), _fixed(128)),)),
        Preset("burst", "background Poisson traffic plus periodic bursts of simultaneous requests", 1.0,
               (RequestClass("default", 1.0, _fixed(256), _fixed(128)),), burst_size=16, burst_interval=10.0),
        Preset("prefill-storm", "long prompts injected into a stream of short interactive ones", 2.0,
               (RequestClass("interactive", 0.9, LengthDistribution.parse("64:128"), _fixed(64)),
                RequestClass("long-prefill", 0.1, _fixed(2048), _fixed(16)))),
        Preset("shared-prefix", "every prompt starts with one of a few long shared prefixes", 2.0,
               (RequestClass("default", 1.0, _fixed(64), _fixed(64)),), prefix_len=512),
        Preset("mixed-priority", "interactive requests mixed with long batch jobs", 2.0,
               (RequestClass("interactive", 0.7, _fixed(128), _fixed(32), priority=0),
                RequestClass("batch", 0.3, _fixed(512), _fixed(256), priority=1))),
    )
}


@dataclass(frozen=True)
class RequestSpec:
    """One request to send. Exactly one of `prompt` (completions) and `messages` (chat) is set."""

    index: int
    request_class: str
    input_tokens: int  # counted with --tokenizer, else estimated (plus the shared prefix, if any)
    max_tokens: int
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    priority: int | None = None


@dataclass
class WorkloadOptions:
    """Overrides on top of a preset; None keeps the preset's value."""

    preset: str = "steady"
    endpoint: str = "completions"
    seed: int = 0
    input_len: LengthDistribution | None = None  # the first (interactive/default) class
    output_len: LengthDistribution | None = None
    long_input_len: LengthDistribution | None = None  # prefill-storm's long class
    long_output_len: LengthDistribution | None = None
    long_fraction: float | None = None
    batch_input_len: LengthDistribution | None = None  # mixed-priority's batch class
    batch_output_len: LengthDistribution | None = None
    batch_fraction: float | None = None
    prefix_len: int | None = None
    num_prefixes: int = 1
    dataset: str | None = None


def resolve_classes(options: WorkloadOptions) -> tuple[RequestClass, ...]:
    """The preset's request classes with the command-line overrides applied."""
    classes = list(PRESETS[options.preset].classes)
    first = classes[0]
    classes[0] = replace(first, input_len=options.input_len or first.input_len,
                         output_len=options.output_len or first.output_len)
    for position, request_class in enumerate(classes[1:], start=1):
        if request_class.name == "long-prefill":
            weight = options.long_fraction if options.long_fraction is not None else request_class.weight
            classes[position] = replace(request_class, weight=weight,
                                        input_len=options.long_input_len or request_class.input_len,
                                        output_len=options.long_output_len or request_class.output_len)
            classes[0] = replace(classes[0], weight=1.0 - weight)
        elif request_class.name == "batch":
            weight = options.batch_fraction if options.batch_fraction is not None else request_class.weight
            classes[position] = replace(request_class, weight=weight,
                                        input_len=options.batch_input_len or request_class.input_len,
                                        output_len=options.batch_output_len or request_class.output_len)
            classes[0] = replace(classes[0], weight=1.0 - weight)
    if any(not 0.0 <= request_class.weight <= 1.0 for request_class in classes):
        raise ValueError("class fractions must lie in [0, 1]")
    return tuple(classes)


def load_dataset(path: str) -> list[dict[str, Any]]:
    """JSONL: one object per line with `prompt` (text) or `messages` (chat) or `conversations` (ShareGPT),
    optionally `max_tokens` and `class`."""
    entries: list[dict[str, Any]] = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number}: not JSON ({error.msg})") from error
        if not isinstance(entry, dict):
            raise ValueError(f"{path}:{number}: expected a JSON object")
        if "conversations" in entry and "messages" not in entry:
            roles = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                     "system": "system"}
            turns = [{"role": roles.get(turn.get("from", "user"), "user"), "content": turn.get("value", "")}
                     for turn in entry["conversations"]]
            # Replay up to the last user turn: the model is asked to write the reply.
            while turns and turns[-1]["role"] != "user":
                turns.pop()
            entry = {**entry, "messages": turns}
        if not isinstance(entry.get("prompt"), str) and not entry.get("messages"):
            raise ValueError(f"{path}:{number}: needs 'prompt' (a string) or 'messages'")
        entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no prompts")
    return entries


def _message_text(messages: list[dict[str, Any]]) -> str:
    parts = []
    for message in messages:
        content = message.get("content", "")
        if isinstance(content, list):  # OpenAI text parts
            content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
        parts.append(f"{message.get('role', 'user')}: {content}")
    return "\n".join(parts)


class Workload:
    """Request `i` of a run, built from (seed, i) alone."""

    def __init__(self, options: WorkloadOptions, counter: TokenCounter | None = None) -> None:
        if options.preset not in PRESETS:
            raise ValueError(f"unknown preset {options.preset!r}; choose from {', '.join(PRESETS)}")
        if options.endpoint not in ("completions", "chat"):
            raise ValueError("endpoint must be 'completions' or 'chat'")
        self.options = options
        self.preset = PRESETS[options.preset]
        self.counter = counter or TokenCounter()
        self.classes = resolve_classes(options)
        self.dataset = load_dataset(options.dataset) if options.dataset else None
        prefix_len = options.prefix_len if options.prefix_len is not None else self.preset.prefix_len
        self.prefixes = [
            self.counter.make_text(random.Random(f"{options.seed}:prefix:{group}"), prefix_len) + "\n"
            for group in range(max(options.num_prefixes, 1))
        ] if prefix_len > 0 else []
        self.prefix_tokens = [self.counter.count_filler(prefix) for prefix in self.prefixes]

    def describe(self) -> dict[str, Any]:
        return {
            "preset": self.preset.name,
            "description": self.preset.description,
            "dataset": self.options.dataset,
            "token_counting": "tokenizer" if self.counter.exact else "estimate",
            "classes": [
                {"name": c.name, "fraction": c.weight, "input_len": str(c.input_len),
                 "output_len": str(c.output_len), "priority": c.priority}
                for c in self.classes
            ],
            "prefix_tokens": self.prefix_tokens[0] if self.prefix_tokens else 0,
            "num_prefixes": len(self.prefixes),
        }

    def _choose_class(self, rng: random.Random) -> RequestClass:
        point = rng.random() * sum(c.weight for c in self.classes)
        for request_class in self.classes:
            point -= request_class.weight
            if point < 0:
                return request_class
        return self.classes[-1]

    def request(self, index: int) -> RequestSpec:
        rng = random.Random(f"{self.options.seed}:request:{index}")
        request_class = self._choose_class(rng)
        max_tokens = request_class.output_len.sample(rng)
        chat = self.options.endpoint == "chat"
        if self.dataset is not None:
            entry = self.dataset[index % len(self.dataset)]
            if isinstance(entry.get("max_tokens"), int):
                max_tokens = entry["max_tokens"]
            name = str(entry.get("class", request_class.name))
            if entry.get("messages"):
                messages = entry["messages"]
                text = _message_text(messages)
            else:
                text = entry["prompt"]
                messages = [{"role": "user", "content": text}]
            return RequestSpec(index, name, self.counter.count(text), max_tokens,
                               prompt=None if chat else text, messages=messages if chat else None,
                               priority=request_class.priority)
        input_len = request_class.input_len.sample(rng)
        body = self.counter.make_text(rng, input_len)
        input_tokens = self.counter.count_filler(body)
        prefix = ""
        if self.prefixes:
            group = rng.randrange(len(self.prefixes))
            prefix = self.prefixes[group]
            input_tokens += self.prefix_tokens[group]
        return self._spec(RequestSpec(index, request_class.name, input_tokens, max_tokens,
                                      priority=request_class.priority), prefix, body)

    def warm_up_requests(self) -> list[RequestSpec]:
        """One 1-token request per shared prefix, each with its own short body: sent before the run, they
        leave the prefixes in the server's prefix cache, as a hot system prompt would be."""
        specs = []
        for group, prefix in enumerate(self.prefixes):
            body = self.counter.make_text(random.Random(f"{self.options.seed}:warm:{group}"), 16)
            tokens = self.prefix_tokens[group] + self.counter.count_filler(body)
            specs.append(self._spec(RequestSpec(-1 - group, "warm-up", tokens, 1), prefix, body))
        return specs

    def _spec(self, spec: RequestSpec, prefix: str, body: str) -> RequestSpec:
        """`spec` with its prompt: the prefix as a system message (chat), or prepended to the body."""
        if self.options.endpoint == "chat":
            messages = [{"role": "user", "content": body}]
            if prefix:  # a shared system prompt is how chat traffic shares prefixes in practice
                messages.insert(0, {"role": "system", "content": prefix.rstrip("\n")})
            return replace(spec, messages=messages)
        return replace(spec, prompt=prefix + body)
