"""A request's state inside the engine: tokens, progress and the KV blocks it holds."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from titan.engine.sampling_params import SamplingParams
from titan.engine.timeline import RequestTimeline

if TYPE_CHECKING:
    from titan.engine.scheduler_output import TokenLogprobs
    from titan.engine.structured import GrammarState


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"  # EOS, stop token or stop string
    FINISHED_LENGTH = "length"  # max_tokens or the context limit
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH,
                        SequenceStatus.FINISHED_ABORTED)


_seq_counter = itertools.count()


class Sequence:
    def __init__(
        self,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.sampling_params = sampling_params
        self.priority = priority
        # Priority with aging applied, frozen when the sequence was last admitted (priority policies).
        self.effective_priority: float = priority
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.status = SequenceStatus.WAITING
        # Tokens whose K/V are in the cache (includes prefix-cache hits).
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prefix-cache hit of the first admission
        self.block_table: list[int] = []
        # Chained hashes of this sequence's full blocks (prefix caching); tokens never change, so they
        # stay valid across preemption. The salt seeds the chain: only equal salts share cached blocks.
        self.cache_salt = cache_salt
        self.block_hashes: list[bytes] = []
        # Preemption cost: tokens whose K/V were dropped and recomputed, and seconds spent requeued.
        self.num_preemptions = 0
        self.num_recomputed_tokens = 0
        self.preempted_seconds = 0.0
        self.preempted_at: float | None = None
        # Steps the slo policy let run past this sequence's ITL target (a budget's itl_cost counts first ones).
        self.itl_excursions = 0
        # Timeline (time.monotonic()); None until it happens.
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None
        self.stop_reason: int | str | None = None
        self.timeline = RequestTimeline()
        # Degradations applied under pressure (admission), e.g. {"max_tokens": {"requested": 512, "applied": 64}}.
        self.degradations: dict[str, dict[str, int]] = {}
        # Prompt logprobs by position (position 0 has none); filled as chunks commit, rewritten if recomputed.
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * len(self.prompt_token_ids)
        # Structured outputs: where the output stands in its grammar (set by the engine at admission).
        self.grammar: GrammarState | None = None
        # Speculative decoding: drafts proposed after the last step (verified by the next one), the
        # estimated chance that the first draft is accepted, and that a draft is accepted once the one
        # before it was (None until verified: the server's recent averages are used; see
        # titan.engine.spec.planner).
        self.draft_token_ids: list[int] = []
        self.spec_acceptance: float | None = None
        self.spec_continuation: float | None = None
        # A private generator makes seeded sampling independent of the batch it runs in.
        self.generator: torch.Generator | None = None
        if sampling_params.seed is not None:
            self.generator = torch.Generator()
            self.generator.manual_seed(sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len:end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - prompt_len]

    def aged_priority(self, now: float, aging_seconds: float) -> float:
        """Every `aging_seconds` spent since arrival is worth one priority level (0: no aging): nothing starves."""
        if aging_seconds > 0:
            return self.priority - (now - self.arrival_time) // aging_seconds
        return self.priority

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, status={self.status.value}, tokens={self.num_tokens}, "
                f"computed={self.num_computed_tokens}, blocks={len(self.block_table)})")


@dataclass
class Advanced:
    """The tokens one step appended to a sequence: one, or several when drafts were accepted; with their
    logprob entries (None where none were asked for)."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]
