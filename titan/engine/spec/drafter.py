"""The propose stage: after a step committed, each running decode gets the drafts the next step may verify."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from titan.config import SpeculativeConfig
from titan.engine.sequence import Sequence
from titan.engine.spec.ngram import NgramIndex

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
    """Prompt lookup, with each running sequence's n-gram index kept from step to step (a sequence gains
    a token or a few per step, so its index is extended, not rebuilt)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.lookup_max, self.lookup_min = config.prompt_lookup_max, config.prompt_lookup_min
        self.num_tokens = config.num_speculative_tokens
        self.indexes: dict[int, NgramIndex] = {}  # seq_id → index; only running sequences are kept

    def propose(self, running: list[Sequence]) -> None:
        indexes: dict[int, NgramIndex] = {}
        for seq in running:
            seq.draft_token_ids = []
            if seq.grammar is not None:  # never speculated
                continue
            index = self.indexes.get(seq.seq_id)
            if index is None or len(index.tokens) > seq.num_tokens:  # new, or its tokens were cut
                index = NgramIndex(self.lookup_max, self.lookup_min)
            indexes[seq.seq_id] = index
            # A prompt is indexed chunk by chunk as it is prefilled, not all at its first decode, where a
            # 32K-token prompt would stall every stream's step by ~50 ms.
            decoding = wants_drafts(seq)
            known = seq.num_tokens if decoding else seq.num_computed_tokens
            index.extend(seq.token_ids_slice(len(index.tokens), known))
            if decoding:
                seq.draft_token_ids = index.propose(self.num_tokens)
        self.indexes = indexes  # a preempted or finished sequence's index goes (rebuilt if it returns)


def make_drafter(config: SpeculativeConfig, engine: LLMEngine) -> Drafter:
    if config.method == "ngram":
        return NgramDrafter(config)
    from titan.engine.spec.draft_model import DraftModelDrafter  # loads a model: only when asked for

    return DraftModelDrafter(config, engine)
