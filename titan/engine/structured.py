"""Structured outputs: a grammar per request (JSON schema, any JSON object, regex, choice, Lark/GBNF),
enforced with llguidance token masks.

Compiling a grammar can take long for a big schema, so the server compiles it off the engine thread
(`GrammarCompiler.compile`, called from a worker thread before the request is submitted) into a cache
of fresh matchers; the engine then only copies the cached matcher for each sequence. The sampler masks
every constrained row of a step at once (one bitmask tensor, one vectorized unpack); commit advances each
sequence's matcher by the token it accepted.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import torch
from llguidance.gbnf_to_lark import GbnfToLarkError, any_to_lark

from titan.tokenizer import Tokenizer

STRUCTURED_KINDS = ("json", "json_object", "regex", "choice", "grammar")
# JSON on one line with OpenAI's separators: flexible whitespace lets a small model wander into endless
# newlines and indentation instead of closing the object. A schema's own "x-guidance" options still win.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_GRAMMAR_CACHE_SIZE = 64


class GrammarError(ValueError):
    """The request's grammar cannot be compiled; `param` names the request field that carried it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class StructuredOutputs:
    """One constraint: `kind` is one of STRUCTURED_KINDS; `spec` its canonical text (a JSON schema as
    JSON in its own key order, a regex, choices as a JSON list, a grammar). `param` names the request
    field it came from."""

    kind: str
    spec: str
    param: str = "structured_outputs"

    def __post_init__(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise GrammarError(f"unknown structured output kind {self.kind!r}", self.param)

    @classmethod
    def of(cls, kind: str, value: Any, param: str) -> StructuredOutputs:
        if kind == "json":
            # Key order kept: properties come out in the schema's order (OpenAI's behaviour; a tool call's
            # name then precedes its arguments, so a stream can announce the call early).
            spec = value if isinstance(value, str) else json.dumps(value)
        elif kind == "choice":
            if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
                raise GrammarError("choice must be a non-empty list of strings", param)
            spec = json.dumps(value)
        elif kind == "json_object":
            spec = ""
        else:
            if not isinstance(value, str) or not value:
                raise GrammarError(f"{param} must be a non-empty string", param)
            spec = value
        return cls(kind, spec, param)

    def grammar(self) -> str:
        """llguidance's grammar for this constraint."""
        matcher = llguidance.LLMatcher
        if self.kind == "json":
            return matcher.grammar_from_json_schema(self.spec, defaults=JSON_OPTIONS)
        if self.kind == "json_object":
            return matcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return matcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            return matcher.grammar_from_regex("|".join(re.escape(choice) for choice in json.loads(self.spec)))
        # vLLM's guided_grammar is usually GBNF/EBNF ("::="); llguidance speaks Lark and converts the rest.
        return matcher.grammar_from_lark(any_to_lark(self.spec))


class GrammarState:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self.matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        view = bitmask[row]
        self.matcher.unsafe_compute_mask_ptr(view.data_ptr(), view.numel() * view.element_size())

    def accept(self, token_id: int) -> None:
        self.matcher.consume_token(token_id)

    @property
    def finished(self) -> bool:
        """Nothing more may follow (the grammar ended, EOS was taken, or a token it refused came in)."""
        return self.matcher.is_stopped() or self.matcher.is_error()


class GrammarCompiler:
    """Thread-safe: grammars compile in server worker threads while the engine thread copies matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_cached: int = DEFAULT_GRAMMAR_CACHE_SIZE) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._max_cached = max_cached
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._cache: OrderedDict[tuple[str, str], llguidance.LLMatcher] = OrderedDict()

    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:  # built once (~0.2 s for a 49k vocabulary), on first use
            if self._ll_tokenizer is None:
                self._ll_tokenizer = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self._vocab_size,
                    eos_token=sorted(self._tokenizer.eos_token_ids))
            return self._ll_tokenizer

    def compile(self, constraint: StructuredOutputs) -> llguidance.LLMatcher:
        """The cached fresh matcher for `constraint`, compiling it if needed; GrammarError if it cannot."""
        key = (constraint.kind, constraint.spec)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        try:
            grammar = constraint.grammar()
        except (ValueError, GbnfToLarkError) as error:  # the GBNF converter's error is no ValueError
            raise GrammarError(f"invalid {constraint.param}: {error}", constraint.param) from error
        matcher = llguidance.LLMatcher(self._llg_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(f"invalid {constraint.param}: {matcher.get_error()}", constraint.param)
        with self._lock:
            self._cache[key] = matcher
            while len(self._cache) > self._max_cached:
                self._cache.popitem(last=False)
        return matcher

    def new_state(self, constraint: StructuredOutputs) -> GrammarState:
        return GrammarState(self.compile(constraint).deep_copy())


def apply_grammar_masks(logits: torch.Tensor, rows: list[int], states: list[GrammarState]) -> None:
    """Set to -inf (in place) every token the grammar forbids, for all constrained rows at once."""
    vocab_size = logits.shape[-1]
    words = (vocab_size + 31) // 32
    bitmask = torch.empty((len(rows), words), dtype=torch.int32)
    for index, state in enumerate(states):
        state.fill_bitmask(bitmask, index)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    allowed = bits.view(len(rows), words * 32)[:, :vocab_size].bool().to(logits.device)
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
