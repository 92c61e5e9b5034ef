"""Iteration-level scheduling: which tokens of which sequences run in the next step.

Every step has a token budget and a sequence cap. Running sequences go first (a decode needs one
token); the remaining budget feeds prefill chunks of waiting requests, so a long prompt is spread over
several steps and shares each of them with the decodes. When KV blocks run out, the lowest-priority,
latest-arrived running sequence is preempted: its blocks are freed and it is recomputed later.
"""

from __future__ import annotations

import bisect
import time
from collections import deque

from titan.config import SchedulerConfig
from titan.engine.block_manager import BlockManager, cdiv
from titan.engine.scheduler_output import RunnerOutput, ScheduledSequence, SchedulerOutput
from titan.engine.sequence import Sequence, SequenceStatus


class RequestRejectedError(ValueError):
    """The request can never run (too long for the context or the KV pool); `param` names the cause."""

    def __init__(self, message: str, param: str = "prompt") -> None:
        super().__init__(message)
        self.param = param


def _order_key(seq: Sequence) -> tuple[int, float, int]:
    # Lower priority value runs first (as vLLM); ties go to the earlier arrival.
    return (seq.priority, seq.arrival_time, seq.seq_id)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # kept sorted by _order_key; victims come from the tail
        self.sequences: dict[int, Sequence] = {}
        self.num_preemptions = 0

    # ---- admission -----------------------------------------------------------------------------
    def max_length(self, seq: Sequence) -> int:
        """The most tokens (prompt + output) this sequence can ever hold."""
        max_tokens = seq.sampling_params.max_tokens
        limit = self.max_model_len if max_tokens is None else seq.num_prompt_tokens + max_tokens
        return min(limit, self.max_model_len)

    def check_admissible(self, seq: Sequence) -> None:
        if seq.num_prompt_tokens == 0:
            raise RequestRejectedError("the prompt is empty", param="prompt")
        if seq.num_prompt_tokens >= self.max_model_len:
            raise RequestRejectedError(
                f"the prompt has {seq.num_prompt_tokens} tokens, but this model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate"
            )
        needed = cdiv(self.max_length(seq), self.block_manager.block_size)
        if needed > self.block_manager.num_blocks:
            raise RequestRejectedError(
                f"the request needs up to {self.max_length(seq)} tokens of KV cache ({needed} blocks), "
                f"but the whole cache holds {self.block_manager.num_blocks} blocks; "
                "lower max_tokens or raise --kv-cache-memory",
                param="max_tokens",
            )

    def add(self, seq: Sequence) -> None:
        self.check_admissible(seq)
        seq.status = SequenceStatus.WAITING
        self.sequences[seq.seq_id] = seq
        self.waiting.append(seq)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- one step ------------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        output = SchedulerOutput()
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate(seq, num_new):
                victim = self.running[-1]
                self._preempt(victim)
                output.preempted_seq_ids.append(victim.seq_id)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                break  # it preempted itself: nothing behind it is left to schedule
            output.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
            index += 1

        # A step that had to preempt admits nothing new: memory is already short.
        while (self.waiting and budget > 0 and not output.preempted_seq_ids
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            cached_blocks = self.block_manager.find_cached_prefix(seq)
            num_cached = len(cached_blocks) * self.block_manager.block_size
            num_new = min(seq.num_tokens - num_cached, budget)
            seq.num_computed_tokens = num_cached
            if not self.block_manager.allocate(seq, num_new, cached_blocks):
                seq.num_computed_tokens = 0
                break
            self.waiting.popleft()
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = num_cached
                seq.first_scheduled_time = time.monotonic()
            seq.status = SequenceStatus.RUNNING
            bisect.insort(self.running, seq, key=_order_key)
            output.scheduled.append(self._scheduled(seq, num_new))
            budget -= num_new
        return output

    def _scheduled(self, seq: Sequence, num_new: int) -> ScheduledSequence:
        start = seq.num_computed_tokens
        return ScheduledSequence(
            seq_id=seq.seq_id,
            token_ids=seq.token_ids_slice(start, start + num_new),
            start_position=start,
            block_table=seq.block_table,
            sample=start + num_new == seq.num_tokens,
            sampling_params=seq.sampling_params,
            prompt_token_ids=seq.prompt_token_ids,
            output_token_ids=seq.output_token_ids,
            generator=seq.generator,
        )

    def _preempt(self, seq: Sequence) -> None:
        """Drop the sequence's KV blocks and requeue it at the front; it recomputes on return."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Sequence]:
        """Account the computed tokens and append sampled ones; returns the sequences that got a token."""
        for scheduled in output.scheduled:
            seq = self.sequences.get(scheduled.seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING:
                seq.num_computed_tokens += scheduled.num_new_tokens
        advanced: list[Sequence] = []
        now = time.monotonic()
        for seq_id, token_id in zip(runner_output.seq_ids, runner_output.token_ids, strict=True):
            seq = self.sequences.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue  # aborted while the step ran
            seq.output_token_ids.append(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
            advanced.append(seq)
            status = self._stop_status(seq, token_id)
            if status is not None:
                self.finish(seq, status)
        return advanced

    def _stop_status(self, seq: Sequence, token_id: int) -> SequenceStatus | None:
        params = seq.sampling_params
        if seq.num_output_tokens >= params.min_tokens:
            if token_id in self.eos_token_ids and not params.ignore_eos:
                return SequenceStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                seq.stop_reason = token_id
                return SequenceStatus.FINISHED_STOPPED
        if seq.num_tokens >= self.max_length(seq):
            return SequenceStatus.FINISHED_LENGTH
        return None

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End a sequence (stopped, length or aborted) and free all its blocks at once."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = status
        seq.finished_time = time.monotonic()
        self.sequences.pop(seq.seq_id, None)

    def abort(self, seq_id: int) -> Sequence | None:
        seq = self.sequences.get(seq_id)
        if seq is not None:
            self.finish(seq, SequenceStatus.FINISHED_ABORTED)
        return seq
