"""Verifying drafts inside one step: sample every position of a sequence, keep drafts while they agree.

Drafts are deterministic proposals (a point mass q on each draft token), for which the rejection sampling
of Leviathan et al. / Chen et al. accepts draft d with probability p(d) and otherwise samples from p with d
removed. Drawing x ~ p with the uniform that position would have used anyway and accepting iff x == d
realizes exactly that: P(accept) = p(d), and on rejection x is distributed as p restricted to x != d.
Every position's p is the target model's, after penalties, bans, bias and filters computed with the
drafts before it as history, so the output distribution is the non-speculative one; and because each
output position consumes the same uniform as without speculation, a seeded request produces the very
same tokens (its generator is rewound past the positions that were rejected).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from titan.engine.sampler import GREEDY_TEMPERATURE, draw_uniform
from titan.engine.scheduler_output import RunnerOutput, ScheduledSequence, TokenLogprobs, Verification


def sampling_rows(item: ScheduledSequence) -> list[ScheduledSequence]:
    """One sampling request per position to sample: the last new token, or with drafts every new token,
    each seeing the drafts before it as output history."""
    drafts = item.draft_token_ids
    if not drafts:
        return [item]
    if item.grammar is not None:
        raise ValueError("drafts of a grammar-constrained sequence cannot be verified")
    return [replace(item, output_token_ids=item.output_token_ids + drafts[:index], draft_token_ids=[])
            for index in range(len(drafts) + 1)]


def generator_states(scheduled: list[ScheduledSequence]) -> dict[int, torch.Tensor]:
    """Before sampling: the state of each seeded, random sequence's generator that has drafts."""
    return {item.seq_id: item.generator.get_state() for item in scheduled
            if item.draft_token_ids and item.generator is not None
            and item.sampling_params.temperature >= GREEDY_TEMPERATURE}


def accept(
    scheduled: list[ScheduledSequence],
    token_ids: list[int],
    logprobs: list[TokenLogprobs | None],
    states: dict[int, torch.Tensor],
) -> RunnerOutput:
    """Sampled rows (in `sampling_rows` order) → the step's tokens: every non-draft row's token, and per
    sequence with drafts the agreeing drafts plus the token sampled where they first disagree (or one past
    the last draft)."""
    output = RunnerOutput()
    row = 0
    for item in scheduled:
        if not item.sample:
            continue
        drafts = item.draft_token_ids
        accepted = 0
        while accepted < len(drafts) and token_ids[row + accepted] == drafts[accepted]:
            accepted += 1
        kept = accepted + 1
        output.seq_ids.extend([item.seq_id] * kept)
        output.token_ids.extend(token_ids[row:row + kept])
        output.logprobs.extend(logprobs[row:row + kept])
        if drafts:
            output.verifications.append(Verification(item.seq_id, len(drafts), accepted))
            state = states.get(item.seq_id)
            if state is not None and accepted < len(drafts):
                # Rewind, then consume one uniform per kept position: the rejected positions will be
                # sampled again next step with the uniforms they would have had without speculation.
                item.generator.set_state(state)
                for _ in range(kept):
                    draw_uniform(item.generator)
        row += len(drafts) + 1
    return output
