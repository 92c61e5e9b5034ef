"""The propose stage: after a step committed, each running decode gets the drafts the next step may verify."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from titan.config import SpeculativeConfig
from titan.engine.sequence import Sequence
from titan.engine.spec.ngram import NgramProposer

if TYPE_CHECKING:
    from titan.engine.llm_engine import LLMEngine


class Drafter(Protocol):
    def propose(self, running: list[Sequence]) -> None:
        """Set `draft_token_ids` of every running sequence (empty where it has none)."""
        ...


def wants_drafts(seq: Sequence) -> bool:
    """Decodes only; a grammar-constrained sequence is never speculated (its matcher advances token by token)."""
    return seq.num_tokens - seq.num_computed_tokens == 1 and seq.grammar is None


class NgramDrafter:
    def __init__(self, config: SpeculativeConfig) -> None:
        self.proposer = NgramProposer(config.prompt_lookup_max, config.prompt_lookup_min)
        self.num_tokens = config.num_speculative_tokens

    def propose(self, running: list[Sequence]) -> None:
        for seq in running:
            seq.draft_token_ids = (self.proposer.propose(seq.prompt_token_ids + seq.output_token_ids, self.num_tokens)
                                   if wants_drafts(seq) else [])


def make_drafter(config: SpeculativeConfig, engine: LLMEngine) -> Drafter:
    if config.method == "ngram":
        return NgramDrafter(config)
    from titan.engine.spec.draft_model import DraftModelDrafter  # loads a model: only when asked for

    return DraftModelDrafter(config, engine)
