"""The commit stage: what a step's results do to its sequences once the runner returned.

Computed tokens advance, rejected drafts roll back, sampled tokens are appended, the blocks now written are
published to the prefix cache, and sequences that hit a stop token, a stop string or their length end. The
scheduler owns the sequences; this stage changes them only through what it is given here.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from titan.engine.block_manager import BlockManager
from titan.engine.scheduler_output import RunnerOutput, SchedulerOutput
from titan.engine.sequence import Advanced, Sequence, SequenceStatus
from titan.engine.spec.planner import SpeculationPlanner


class CommitStage:
    def __init__(
        self,
        sequences: dict[int, Sequence],
        block_manager: BlockManager,
        eos_token_ids: frozenset[int],
        max_length: Callable[[Sequence], int],
        finish: Callable[[Sequence, SequenceStatus], None],
        speculation: SpeculationPlanner | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.sequences = sequences  # the scheduler's live sequences, by id (finished ones are gone)
        self.block_manager = block_manager
        self.eos_token_ids = eos_token_ids
        self.max_length = max_length
        self.finish = finish  # the scheduler's: frees the blocks and forgets the sequence
        self.speculation = speculation
        self.clock = clock

    def commit(self, output: SchedulerOutput, runner_output: RunnerOutput) -> list[Advanced]:
        """After the runner returned: advance computed tokens, publish the blocks now written to the prefix
        cache, append sampled tokens and end sequences that hit a stop token or their length. Returns what
        each sequence got. A sequence preempted or aborted since it was scheduled is skipped, so none of its
        unwritten blocks is ever published. Rejected drafts are rolled back before anything is published:
        their positions do not count as computed and the blocks past the accepted tokens are freed."""
        verified = {v.seq_id: v for v in runner_output.verifications}
        computed: list[Sequence] = []
        for scheduled in output.scheduled:
            seq = self.sequences.get(scheduled.seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING:
                continue
            rejected = 0
            verification = verified.get(seq.seq_id)
            if verification is not None:
                rejected = verification.num_drafts - verification.num_accepted
                if self.speculation is not None:
                    self.speculation.record(seq, verification.num_drafts, verification.num_accepted)
            seq.num_computed_tokens += scheduled.num_new_tokens - rejected
            if rejected:
                # Keep the blocks up to the next position to compute (the token sampled now).
                self.block_manager.trim(seq, seq.num_computed_tokens + 1)
            computed.append(seq)
        for chunk in runner_output.prompt_logprobs:
            seq = self.sequences.get(chunk.seq_id)
            if seq is not None and seq.status is SequenceStatus.RUNNING and seq.prompt_logprobs is not None:
                seq.prompt_logprobs[chunk.first_position:chunk.first_position + len(chunk.entries)] = chunk.entries
        advanced: dict[int, Advanced] = {}
        stopped: dict[int, tuple[Sequence, SequenceStatus]] = {}
        now = self.clock()
        for seq_id, token_id, entry in zip(runner_output.seq_ids, runner_output.token_ids, runner_output.logprobs,
                                           strict=True):
            seq = self.sequences.get(seq_id)
            if seq is None or seq.status is not SequenceStatus.RUNNING or seq_id in stopped:
                continue  # aborted while the step ran, or stopped by an earlier token of this step
            seq.output_token_ids.append(token_id)
            if seq.grammar is not None:
                seq.grammar.accept(token_id)
            if seq.first_token_time is None:
                seq.first_token_time = now
            if seq_id not in advanced:
                advanced[seq_id] = Advanced(seq, [], [])
            advanced[seq_id].token_ids.append(token_id)
            advanced[seq_id].logprobs.append(entry)
            status = self._stop_status(seq, token_id)
            if status is not None:
                stopped[seq_id] = (seq, status)
        # Publish once the accepted drafts are tokens of their sequences (block hashes cover token ids),
        # and before stopped sequences release their blocks.
        for seq in computed:
            self.block_manager.commit(seq)
        for seq, status in stopped.values():
            self.finish(seq, status)
        return list(advanced.values())

    def stop(self, stopped: list[tuple[Sequence, str, int]]) -> None:
        """End sequences the output stage found a stop string in (the string becomes their stop reason),
        keeping the output tokens up to the one that completed it."""
        for seq, stop_string, num_output_tokens in stopped:
            if seq.status is SequenceStatus.FINISHED_ABORTED:
                continue
            del seq.output_token_ids[num_output_tokens:]
            seq.stop_reason = stop_string
            if seq.is_finished:  # by a later token of the same step: the stop string came first
                seq.status = SequenceStatus.FINISHED_STOPPED
            else:
                self.finish(seq, SequenceStatus.FINISHED_STOPPED)

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
        if seq.grammar is not None and seq.grammar.finished:
            return SequenceStatus.FINISHED_STOPPED  # the grammar allows nothing more
        return None
