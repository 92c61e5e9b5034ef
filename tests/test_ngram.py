"""Prompt lookup: the incremental n-gram index drafts exactly what a scan of the whole sequence would."""

from __future__ import annotations

import random

from titan.config import SpeculativeConfig
from titan.engine.sampling_params import SamplingParams
from titan.engine.sequence import Sequence
from titan.engine.spec.drafter import NgramDrafter
from titan.engine.spec.ngram import NgramIndex


def scanned(tokens: list[int], lookup_max: int, lookup_min: int, num_tokens: int) -> list[int]:
    """The rule spelled as a scan: for n = max .. min, the latest earlier occurrence of the last n tokens."""
    last = len(tokens) - 1
    if num_tokens <= 0 or last < lookup_min:
        return []
    for n in range(min(lookup_max, last), lookup_min - 1, -1):
        suffix = tokens[last - n + 1:]
        for end in range(last - 1, n - 2, -1):
            if tokens[end - n + 1:end + 1] == suffix:
                return tokens[end + 1:end + 1 + num_tokens]
    return []


def test_the_index_extended_piece_by_piece_drafts_what_a_scan_finds() -> None:
    rng = random.Random(0)
    for _ in range(400):
        lookup_max = rng.randint(1, 5)
        lookup_min = rng.randint(1, lookup_max)
        num_tokens = rng.randint(0, 5)
        tokens = [rng.randrange(rng.randint(2, 6)) for _ in range(rng.randint(0, 40))]
        index, done = NgramIndex(lookup_max, lookup_min), 0
        while done < len(tokens):  # a step adds one token, or several when drafts were accepted
            done = min(len(tokens), done + rng.randint(1, 4))
            index.extend(tokens[len(index.tokens):done])
            assert index.propose(num_tokens) == scanned(tokens[:done], lookup_max, lookup_min, num_tokens)
        whole = NgramIndex(lookup_max, lookup_min)  # the whole list at once, as a preempted sequence returns
        whole.extend(tokens)
        assert whole.propose(num_tokens) == scanned(tokens, lookup_max, lookup_min, num_tokens)


def test_the_drafter_keeps_an_index_per_running_sequence_and_rebuilds_a_cut_one() -> None:
    drafter = NgramDrafter(SpeculativeConfig("ngram", num_speculative_tokens=3, prompt_lookup_max=3,
                                             prompt_lookup_min=1))
    seq = Sequence([1, 2, 3, 4, 1, 2], SamplingParams(max_tokens=16))
    seq.num_computed_tokens = 3  # still prefilling: its prompt is indexed as far as it is computed
    drafter.propose([seq])
    assert seq.draft_token_ids == [] and drafter.indexes[seq.seq_id].tokens == [1, 2, 3]
    seq.num_computed_tokens = seq.num_tokens - 1  # a decode: the last token's K/V is computed next
    drafter.propose([seq])
    assert seq.draft_token_ids == [3, 4, 1]
    seq.output_token_ids += [3, 9]
    seq.num_computed_tokens = seq.num_tokens - 1
    drafter.propose([seq])
    assert seq.draft_token_ids == [] and len(drafter.indexes[seq.seq_id].tokens) == seq.num_tokens
    del seq.output_token_ids[1:]  # tokens cut (a stop string): the index must not draft from the lost 9
    seq.num_computed_tokens = seq.num_tokens - 1
    drafter.propose([seq])
    assert seq.draft_token_ids == [4, 1, 2]
    drafter.propose([])  # the sequence left the running set: its index goes with it
    assert drafter.indexes == {}
