"""The only contract between the scheduler (which decides) and the model runner (which computes)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from titan.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from titan.engine.prefill_budget import BudgetDecision
    from titan.engine.structured import GrammarState


@dataclass
class ScheduledSequence:
    """One sequence's share of a step: compute `token_ids` at positions `start_position`...

    `block_table` maps positions to physical KV blocks and already covers every new position.
    When `sample` is true, the last new token's logits produce the sequence's next token.
    `prompt_token_ids` / `output_token_ids` are the full history (read-only; penalties use it).
    """

    seq_id: int
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None = None
    grammar: GrammarState | None = None  # structured outputs: the sampler masks what it forbids (read-only)
    # Speculative decoding: the last `len(draft_token_ids)` of `token_ids` are unverified drafts; every
    # new token's logits are sampled and the drafts are kept up to the first that disagrees.
    draft_token_ids: list[int] = field(default_factory=list)

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def is_decode(self) -> bool:
        """Mid-stream: one known token to compute (plus any drafts) after the prompt."""
        return (len(self.token_ids) - len(self.draft_token_ids) == 1
                and self.start_position >= len(self.prompt_token_ids))

    @property
    def context_length(self) -> int:
        return self.start_position + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One engine step: decodes (one new token each) come first, then prefill chunks."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    budget: BudgetDecision | None = None  # the slo policy's prefill budget for this step, and why

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class TokenLogprobs:
    """Logprob of the sampled token plus the top-N alternatives (raw model distribution)."""

    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: list[tuple[int, float]]  # (token_id, logprob), most likely first


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens `first_position`, `first_position + 1`, ... of one sequence (one chunk)."""

    seq_id: int
    first_position: int
    entries: list[TokenLogprobs]


@dataclass(frozen=True)
class Verification:
    """How many of a sequence's drafts the step checked and accepted."""

    seq_id: int
    num_drafts: int
    num_accepted: int


@dataclass
class RunnerOutput:
    """What a step produced: one token per sampled sequence, in `scheduled` order (a sequence with drafts
    gets its accepted drafts plus one more, consecutive entries), and the prompt logprobs of the chunks
    whose sequences asked for them."""

    seq_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    verifications: list[Verification] = field(default_factory=list)
