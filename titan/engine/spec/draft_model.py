"""A smaller model with the target's vocabulary drafts greedily, with its own paged KV cache.

Per sequence the drafter keeps a shadow of the target sequence: its own block table and the tokens whose
K/V it has computed. Each propose stage first rolls the shadow back to the longest prefix it shares with
the target's tokens (rejected drafts' K/V are dropped, their blocks freed), then runs up to k rounds over
every drafting sequence at once: the first computes what the draft model has not seen yet (the whole
prompt the first time, later the accepted tokens) and every round samples one greedy draft token.
Drafts are deterministic, so verification (spec.verify) keeps the target's distribution exactly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from titan.config import SpeculativeConfig
from titan.engine.block_manager import BlockManager
from titan.engine.model_runner import ModelRunner
from titan.engine.sampler import Sampler
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler_output import ScheduledSequence, SchedulerOutput
from titan.engine.sequence import Sequence
from titan.engine.spec.drafter import wants_drafts
from titan.loader import load_model_files
from titan.tokenizer import Tokenizer

if TYPE_CHECKING:
    from titan.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=None, temperature=0.0)
DRAFT_COST_RATE = 0.2


class _Shadow:
    """The draft model's view of one target sequence."""

    def __init__(self, seq: Sequence) -> None:
        self.seq = Sequence(seq.prompt_token_ids, GREEDY, request_id=f"draft-{seq.request_id}")
        self.computed: list[int] = []  # tokens whose K/V the draft cache holds, by position


class DraftModelDrafter:
    def __init__(self, config: SpeculativeConfig, engine: LLMEngine) -> None:
        files = load_model_files(config.model, engine.config.quantization)
        target_vocab = engine.model_config.vocab_size
        if files.config.vocab_size != target_vocab:
            raise ValueError(f"the draft model {files.name} has a vocabulary of {files.config.vocab_size} tokens, "
                             f"the served model {target_vocab}: speculation needs the same tokenizer")
        if Tokenizer.from_folder(files.folder).backend.get_vocab() != engine.tokenizer.backend.get_vocab():
            raise ValueError(f"the draft model {files.name} has another tokenizer than the served model: "
                             "speculation needs the same vocabulary")
        self.name = files.name
        self.num_tokens = config.num_speculative_tokens
        self.engine = engine
        block_size = engine.config.cache.block_size
        # As many tokens as the target's pool: every sequence the target holds can be drafted for.
        self.block_manager = BlockManager(engine.num_blocks, block_size, enable_prefix_caching=False)
        self.runner = ModelRunner(files.config, files.weights, engine.num_blocks, block_size, engine.device,
                                  engine.dtype, Sampler(engine.tokenizer.eos_token_ids), engine.kv_cache_dtype)
        self.shadows: dict[int, _Shadow] = {}
        # Seconds one draft token costs (a draft round's time over the sequences in it), averaged: the
        # planner weighs it against the expected gain before anything is drafted.
        self.seconds_per_draft = 0.0

    def propose(self, running: list[Sequence]) -> None:
        live = {seq.seq_id for seq in running}
        for seq_id in [s for s in self.shadows if s not in live]:
            self.block_manager.free(self.shadows.pop(seq_id).seq)
        for seq in running:
            seq.draft_token_ids = []
        wanted = self._wanted([seq for seq in running if wants_drafts(seq)])
        drafting = [(seq, self._shadow(seq)) for seq in running if wanted.get(seq.seq_id, 0) > 0]
        for round_index in range(max(wanted.values(), default=0)):
            batch = [(seq, shadow) for seq, shadow in drafting if wanted[seq.seq_id] > round_index]
            scheduled = []
            for seq, shadow in batch:
                # What the draft cache lacks: the target's tokens it has not seen, then this round's drafts.
                seen = len(shadow.computed)
                total = seq.num_tokens
                pending = seq.token_ids_slice(seen, total) + seq.draft_token_ids[max(0, seen - total):]
                shadow.seq.num_computed_tokens = seen
                if not self.block_manager.allocate(shadow.seq, len(pending)):
                    wanted[seq.seq_id] = round_index  # the draft pool is full: stop drafting for it
                    continue
                scheduled.append(ScheduledSequence(seq.seq_id, pending, len(shadow.computed),
                                                   shadow.seq.block_table, True, GREEDY, [], []))
                shadow.computed += pending
            if not scheduled:
                break
            started = time.perf_counter()
            result = self.runner.execute(SchedulerOutput(scheduled=scheduled))
            per_draft = (time.perf_counter() - started) / len(scheduled)
            self.seconds_per_draft += DRAFT_COST_RATE * (per_draft - self.seconds_per_draft)
            by_id = {seq.seq_id: seq for seq, _ in batch}
            for seq_id, token_id in zip(result.seq_ids, result.token_ids, strict=True):
                by_id[seq_id].draft_token_ids.append(token_id)

    def _wanted(self, candidates: list[Sequence]) -> dict[int, int]:
        """Drafts worth computing per sequence: what the planner would verify if they existed."""
        engine = self.engine
        limits = [(seq, engine.scheduler.max_length(seq) - seq.num_tokens - 1) for seq in candidates]
        assert engine.speculation is not None
        return engine.speculation.choose(limits, {seq.seq_id: self.num_tokens for seq in candidates},
                                         self.seconds_per_draft)

    def _shadow(self, seq: Sequence) -> _Shadow:
        """The sequence's shadow, rolled back to the tokens it shares with the target."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = self.shadows[seq.seq_id] = _Shadow(seq)
        tokens = seq.prompt_token_ids + seq.output_token_ids
        shared = 0
        limit = min(len(shadow.computed), len(tokens) - 1)  # the target's last token is always recomputed
        while shared < limit and shadow.computed[shared] == tokens[shared]:
            shared += 1
        del shadow.computed[shared:]
        self.block_manager.trim(shadow.seq, shared)
        return shadow
