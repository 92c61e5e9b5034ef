"""Sampler tests on synthetic logits: filters, penalties, bans, seeds, logprobs and degenerate rows."""

from __future__ import annotations

import math

import pytest
import torch

from titan.engine.sampler import (
    Sampler,
    apply_min_p,
    apply_top_k_top_p,
    process_logits,
    row_argmax,
    sample_from_probs,
)
from titan.engine.sampling_params import SamplingParams
from titan.engine.scheduler_output import ScheduledSequence

EOS = 2


def make_request(params: SamplingParams | None = None, prompt: list[int] | None = None,
                 output: list[int] | None = None, seq_id: int = 0) -> ScheduledSequence:
    params = params if params is not None else SamplingParams()
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    prompt = prompt if prompt is not None else [5, 6, 7]
    output = output if output is not None else []
    return ScheduledSequence(seq_id=seq_id, token_ids=[(prompt + output)[-1]],
                             start_position=len(prompt) + len(output) - 1, block_table=[0], sample=True,
                             sampling_params=params, prompt_token_ids=prompt, output_token_ids=output,
                             generator=generator)


def empirical(tokens: list[int], vocab_size: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab_size).double()


def chi_square(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """Pearson statistic over tokens with nonzero expectation; any count elsewhere is infinite."""
    expected = expected_probs.double() * counts.sum()
    if bool(((expected == 0) & (counts > 0)).any()):
        return math.inf
    support = expected > 0
    return float((((counts - expected) ** 2)[support] / expected[support]).sum())


def draw_many(logits_row: torch.Tensor, params: SamplingParams, draws: int, seed: int = 0) -> list[int]:
    sampler = Sampler(frozenset({EOS}), seed=seed)
    batch = 2000
    tokens: list[int] = []
    while len(tokens) < draws:
        rows = min(batch, draws - len(tokens))
        out, _ = sampler(logits_row.expand(rows, -1), [make_request(params) for _ in range(rows)])
        tokens += out
    return tokens


# Chi-square critical values at p = 0.001 (so a correct sampler fails about once in a thousand seeds;
# the seeds are fixed, so the tests are deterministic).
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 7: 24.32}


def test_greedy_is_argmax_with_lowest_id_on_ties() -> None:
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1.0  # tie: the lower id wins
    tokens, logprobs = Sampler(frozenset({EOS}))(logits, [make_request(SamplingParams(temperature=0.0))] * 6)
    expected = logits.argmax(dim=-1).tolist()
    expected[3] = 10
    assert tokens == expected
    assert logprobs == [None] * 6


def test_top_k_one_equals_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 300) * 2
    params = SamplingParams(temperature=1.3, top_k=1)
    tokens, _ = Sampler(frozenset({EOS}), seed=5)(logits, [make_request(params) for _ in range(64)])
    assert tokens == logits.argmax(dim=-1).tolist()


def test_small_top_p_keeps_only_the_top_token() -> None:
    logits = torch.tensor([1.0, 3.0, 2.9, 0.5, 2.0])
    tokens = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.01), 500)
    assert set(tokens) == {1}


def test_min_p_filters_relative_to_the_top_probability() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.1, 0.06, 0.04], [0.2, 0.2, 0.2, 0.2, 0.2]])
    filtered = apply_min_p(probs.clone(), torch.tensor([0.25, 0.9]))
    assert torch.equal(filtered, probs * torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1]]))

    logits = probs[0].log()
    tokens = draw_many(logits, SamplingParams(temperature=1.0, min_p=0.25), 4000)
    counts = empirical(tokens, 5)
    assert chi_square(counts, torch.tensor([0.625, 0.375, 0, 0, 0])) < CHI2_CRITICAL[1]


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    tokens = draw_many(logits, SamplingParams(temperature=temperature), 20000, seed=int(temperature * 10))
    expected = torch.softmax(logits / temperature, dim=-1)
    assert chi_square(empirical(tokens, 8), expected) < CHI2_CRITICAL[7]


def test_top_k_and_top_p_distributions() -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2])
    probs = torch.softmax(logits, dim=-1)  # sorted ids: 0, 6, 1, 2, 7, 3, 4, 5

    top_k = torch.zeros(8).index_fill(0, torch.tensor([0, 6, 1]), 1.0) * probs
    tokens = draw_many(logits, SamplingParams(temperature=1.0, top_k=3), 20000, seed=1)
    assert chi_square(empirical(tokens, 8), top_k / top_k.sum()) < CHI2_CRITICAL[2]

    # Nucleus of 0.7: ids 0 and 6 hold ~0.61, so id 1 is needed too.
    assert probs[[0, 6]].sum() < 0.7 < probs[[0, 6, 1]].sum()
    tokens = draw_many(logits, SamplingParams(temperature=1.0, top_p=0.7), 20000, seed=2)
    assert chi_square(empirical(tokens, 8), top_k / top_k.sum()) < CHI2_CRITICAL[2]

    # top-k first, then top-p over the renormalized top-k mass: 0.8 of the top-3 needs ids 0 and 6.
    renormalized = top_k / top_k.sum()
    assert renormalized[0] < 0.8 < renormalized[[0, 6]].sum()
    tokens = draw_many(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.8), 20000, seed=3)
    expected = torch.zeros(8).index_fill(0, torch.tensor([0, 6]), 1.0) * probs
    assert chi_square(empirical(tokens, 8), expected / expected.sum()) < CHI2_CRITICAL[1]


def reference_top_k_top_p(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Straightforward per-row reference: sort, cut at k, cut at the nucleus, keep boundary ties."""
    values = probs.sort(descending=True).values
    if top_k > 0:
        values = values[:top_k]
    mass = values.sum() if top_k > 0 else probs.sum()
    kept = 0
    running = 0.0
    for value in values.tolist():
        if kept > 0 and top_p < 1.0 and running >= top_p * float(mass):
            break
        kept += 1
        running += value
    return probs.masked_fill(probs < values[kept - 1], 0.0)


def test_top_k_top_p_against_reference_including_wide_nucleus() -> None:
    generator = torch.Generator().manual_seed(3)
    # Peaked, medium and flat rows: kept sets within the first 256 candidates, within the 4096-wide
    # second view, and wider than that (full sort).
    scales = torch.tensor([4.0] * 4 + [1.0] * 3 + [0.1] * 3).unsqueeze(1)
    probs = torch.softmax(torch.randn(10, 6000, generator=generator) * scales, dim=-1)
    top_k = [0, 5, 300, 0, 0, 1000, 0, 5000, 0, 50]
    top_p = [0.9, 1.0, 0.95, 0.5, 0.9, 0.7, 0.3, 0.99, 0.95, 0.99]
    filtered = apply_top_k_top_p(probs.clone(), top_k, top_p)
    for row in range(10):
        expected = reference_top_k_top_p(probs[row], top_k[row], top_p[row])
        assert torch.equal(filtered[row], expected), row
    kept = (filtered > 0).sum(dim=-1)
    assert 256 < int(kept[4]) < 4096 and int(kept[7]) > 4096 and int(kept[8]) > 4096


def test_inverse_cdf_survives_block_sum_rounding() -> None:
    # The float32 block sum exceeds the float64 running sum inside the block here; a target near the
    # top must still land on a nonzero token, not on the zero tail of the block.
    probs = torch.zeros(1, 512)
    probs[0, :100] = 0.7
    tokens = sample_from_probs(probs, torch.tensor([1.0 - 2.0**-53], dtype=torch.float64))
    assert tokens.tolist() == [99]


def test_inverse_cdf_follows_the_distribution_across_blocks() -> None:
    # Support spread over several 256-token blocks and the partial last block, with zeros between.
    probs = torch.zeros(1, 1000)
    support = torch.tensor([0, 3, 255, 256, 511, 700, 767, 768, 900, 999])
    weights = torch.tensor([5.0, 1.0, 2.0, 3.0, 0.5, 4.0, 1.5, 2.5, 0.25, 0.25])
    probs[0, support] = weights
    draws = 40000
    uniforms = (torch.arange(draws, dtype=torch.float64) + 0.5) / draws  # stratified: exact counts
    tokens = sample_from_probs(probs.expand(draws, -1), uniforms)
    counts = torch.bincount(tokens, minlength=1000)
    assert int(counts.sum()) == int(counts[support].sum())
    assert torch.allclose(counts[support].double(), weights.double() / weights.sum() * draws, atol=1.0)


def test_top_k_keeps_ties_at_the_boundary() -> None:
    probs = torch.tensor([[0.4, 0.2, 0.2, 0.1, 0.1]])
    assert torch.equal(apply_top_k_top_p(probs.clone(), [2], [1.0]), probs * torch.tensor([1, 1, 1, 0, 0]))


def test_inverse_cdf_never_picks_zero_probability_tokens() -> None:
    probs = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]] * 5)
    uniforms = torch.tensor([0.0, 0.299, 0.31, 0.9999999, 1.0 - 2.0**-53], dtype=torch.float64)
    assert sample_from_probs(probs, uniforms).tolist() == [1, 1, 3, 3, 3]


def test_penalties_change_logits_exactly() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0, 0.0],
                           [2.0, -1.0, 0.5, -3.0, 1.0, 0.0],
                           [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    original = logits.clone()
    requests = [
        # Repetition over prompt (0, 1) and output (3): positive divided, negative multiplied.
        make_request(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[3, 3]),
        # Presence/frequency count output tokens only: token 4 twice, token 0 once; prompt 1 ignored.
        make_request(SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[1],
                     output=[4, 0, 4]),
        make_request(SamplingParams(), prompt=[0, 1], output=[4]),
    ]
    processed = process_logits(logits, requests, frozenset({EOS}))
    assert torch.equal(logits, original)
    expected = torch.tensor([[1.0, -2.0, 0.5, -6.0, 1.0, 0.0],
                             [2.0 - 0.75, -1.0, 0.5, -3.0, 1.0 - 1.0, 0.0],
                             [2.0, -1.0, 0.5, -3.0, 1.0, 0.0]])
    assert torch.allclose(processed, expected, atol=0, rtol=1e-6)

    # Combined: repetition first, then presence/frequency; ids outside the vocabulary are ignored.
    both = process_logits(logits[:1], [make_request(
        SamplingParams(repetition_penalty=1.5, presence_penalty=-1.0, frequency_penalty=1.0),
        prompt=[0, 99], output=[1, 1])], frozenset())
    assert torch.allclose(both, torch.tensor([[2.0 / 1.5, -1.5 + 1.0 - 2.0, 0.5, -3.0, 1.0, 0.0]]))


def test_penalties_steer_greedy_decoding() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    sampler = Sampler(frozenset({EOS}))
    plain, _ = sampler(logits, [make_request(SamplingParams(temperature=0.0), output=[0])])
    penalized, _ = sampler(logits, [make_request(SamplingParams(temperature=0.0, frequency_penalty=0.5),
                                                 output=[0])])
    assert (plain, penalized) == ([0], [1])


def test_allowed_token_ids_restrict_greedy_and_random_rows_alone() -> None:
    logits = torch.tensor([[3.0, 2.9, 1.0, 0.5, 0.0]] * 3)
    sampler = Sampler(frozenset({EOS}), seed=1)
    requests = [make_request(SamplingParams(temperature=0.0, allowed_token_ids=[3, 4])),
                make_request(SamplingParams(temperature=1.0, allowed_token_ids=[2, 3])),
                make_request(SamplingParams(temperature=0.0))]
    drawn = [sampler(logits, requests)[0] for _ in range(50)]
    assert all(tokens[0] == 3 and tokens[1] in (2, 3) and tokens[2] == 0 for tokens in drawn)
    assert {tokens[1] for tokens in drawn} == {2, 3}  # a random row still draws among the allowed ones
    with pytest.raises(ValueError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_bad_words_ban_a_last_token_only_after_the_rest() -> None:
    logits = torch.tensor([[0.0, 0.0, 0.0, 1.0, 2.0, 3.0]])
    sampler = Sampler(frozenset({EOS}))
    words = SamplingParams(temperature=0.0, bad_words_token_ids=[[4, 5], [3]])
    assert sampler(logits, [make_request(words, output=[0])])[0] == [5]  # [4, 5] not begun: 5 is allowed
    assert sampler(logits, [make_request(words, output=[0, 4])])[0] == [4]  # after 4, 5 is banned; 3 always
    assert sampler(logits, [make_request(words, output=[4, 0])])[0] == [5]


def test_min_tokens_bans_eos_and_stop_ids_then_releases_them() -> None:
    logits = torch.tensor([[0.0, 0.0, 9.0, 8.0, 7.0, 1.0]])  # EOS (2), then stop id 3, then 4
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[3])
    sampler = Sampler(frozenset({EOS}))
    assert sampler(logits, [make_request(params, output=[])])[0] == [4]
    assert sampler(logits, [make_request(params, output=[4])])[0] == [4]
    assert sampler(logits, [make_request(params, output=[4, 4])])[0] == [EOS]

    processed = process_logits(logits, [make_request(params, output=[5])], frozenset({EOS, 0}))
    assert processed[0].tolist() == [-math.inf, 0.0, -math.inf, -math.inf, 7.0, 1.0]
    # ignore_eos alone bans nothing: the engine's stop check handles it.
    ignore = SamplingParams(temperature=0.0, ignore_eos=True)
    assert sampler(logits, [make_request(ignore)])[0] == [EOS]


def test_min_tokens_ban_applies_to_random_rows() -> None:
    logits = torch.tensor([0.0, 0.0, 5.0, 0.0])
    tokens = draw_many(logits, SamplingParams(temperature=1.0, min_tokens=1), 2000)
    assert EOS not in tokens and set(tokens) == {0, 1, 3}


def run_seeded(seed: int, steps: int, others: list[SamplingParams], row: int,
               logits: torch.Tensor) -> list[int]:
    """Decode `steps` tokens for one seeded request placed at `row` among `others` in each batch."""
    sampler = Sampler(frozenset({EOS}), seed=1234)
    target = make_request(SamplingParams(temperature=0.9, top_p=0.95, seed=seed))
    companions = [make_request(params, seq_id=i + 1) for i, params in enumerate(others)]
    produced = []
    for step in range(steps):
        batch = companions[:row] + [target] + companions[row:]
        step_logits = logits[step].expand(len(batch), -1).clone()
        # Companions see different logits, so only the target's row is shared between runs.
        companion_rows = [i for i in range(len(batch)) if i != row]
        step_logits[companion_rows] += torch.randn(len(companion_rows), logits.shape[-1])
        tokens, _ = sampler(step_logits, batch)
        produced.append(tokens[row])
    return produced


def test_seeded_rows_do_not_depend_on_the_batch() -> None:
    generator = torch.Generator().manual_seed(7)
    logits = torch.randn(12, 1000, generator=generator)
    others = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=0.7, top_k=500, seed=3), SamplingParams(temperature=1.5, min_p=0.1),
              SamplingParams(temperature=1.0, top_p=0.5, repetition_penalty=1.3),
              SamplingParams(temperature=0.3, seed=99), SamplingParams(temperature=2.0, top_k=5)]
    alone = run_seeded(42, 12, [], 0, logits)
    assert run_seeded(42, 12, others, 0, logits) == alone
    assert run_seeded(42, 12, others, 5, logits) == alone
    assert run_seeded(42, 12, others[:3], 3, logits) == alone
    assert run_seeded(43, 12, others, 2, logits) != alone


def test_unseeded_rows_follow_the_sampler_seed() -> None:
    logits = torch.zeros(16, 1000)
    requests = [make_request(SamplingParams(temperature=1.0)) for _ in range(16)]
    first, _ = Sampler(frozenset({EOS}), seed=1)(logits, requests)
    again, _ = Sampler(frozenset({EOS}), seed=1)(logits, requests)
    other, _ = Sampler(frozenset({EOS}), seed=2)(logits, requests)
    assert first == again and first != other


def test_logprobs_describe_the_raw_distribution() -> None:
    torch.manual_seed(4)
    logits = torch.randn(4, 100) * 3
    requests = [
        make_request(SamplingParams(temperature=0.0, logprobs=5)),
        make_request(SamplingParams(temperature=0.7, top_k=20, repetition_penalty=1.5, logprobs=3, seed=1),
                     output=[int(logits[1].argmax())]),
        make_request(SamplingParams(temperature=1.0)),
        make_request(SamplingParams(temperature=1.0, logprobs=0, seed=2)),
    ]
    tokens, logprobs = Sampler(frozenset({EOS}))(logits, requests)
    reference = torch.log_softmax(logits, dim=-1)
    assert logprobs[2] is None
    for row, count in [(0, 5), (1, 3), (3, 0)]:
        entry = logprobs[row]
        assert entry is not None and entry.token_id == tokens[row]
        assert entry.logprob == pytest.approx(float(reference[row, tokens[row]]), abs=1e-5)
        assert entry.rank == int((reference[row] > reference[row, tokens[row]]).sum()) + 1
        assert len(entry.top) == count
        order = reference[row].argsort(descending=True)[:count].tolist()
        assert [token for token, _ in entry.top] == order
        assert [value for _, value in entry.top] == pytest.approx(reference[row, order].tolist(), abs=1e-5)
    assert logprobs[0] is not None and logprobs[0].rank == 1


def test_fully_masked_or_nan_rows_fall_back_to_raw_argmax() -> None:
    logits = torch.tensor([[1.0, 3.0, 2.0], [0.5, float("nan"), 0.1], [1.0, 3.0, 2.0]])
    banned = SamplingParams(temperature=1.0, min_tokens=5, stop_token_ids=[0])
    requests = [make_request(banned), make_request(SamplingParams(temperature=0.8)), make_request(banned)]
    tokens, _ = Sampler(frozenset({1, 2}))(logits, requests)
    assert tokens == [1, 0, 1]


def test_half_precision_logits_and_mixed_batch() -> None:
    generator = torch.Generator().manual_seed(9)
    logits = (torch.randn(5, 64, generator=generator) * 3).to(torch.bfloat16)
    requests = [make_request(SamplingParams(temperature=0.0)),
                make_request(SamplingParams(temperature=1.0, top_k=1)),
                make_request(SamplingParams(temperature=1.0, top_p=1e-3)),
                make_request(SamplingParams(temperature=1.0, min_p=1.0)),
                make_request(SamplingParams(temperature=0.5, logprobs=2))]
    tokens, logprobs = Sampler(frozenset({EOS}))(logits, requests)
    argmax = logits.float().argmax(dim=-1).tolist()
    assert tokens[:4] == argmax[:4]
    assert logprobs[4] is not None and len(logprobs[4].top) == 2


def test_rejects_mismatched_batch() -> None:
    with pytest.raises(ValueError):
        Sampler(frozenset({EOS}))(torch.zeros(2, 4), [make_request()])
    assert Sampler(frozenset({EOS}))(torch.zeros(0, 4), []) == ([], [])


def test_row_argmax_matches_torch_max() -> None:
    """The numpy path (CPU float32) against torch.max: first max on ties, NaN as the max, all -inf, +inf,
    a strided view; other dtypes keep torch's path."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(5))
    logits[1, 7] = logits[1, 9] = 1e9
    logits[2, 3] = float("nan")
    logits[3, :] = float("-inf")
    logits[4, 50] = logits[4, 60] = float("inf")
    for values in (logits, logits[:, ::3], logits.bfloat16()):
        got_max, got_index = row_argmax(values)
        want_max, want_index = values.max(dim=-1)
        assert got_index.tolist() == want_index.tolist()
        assert torch.equal(got_max.isnan(), want_max.isnan())
        assert torch.equal(got_max.nan_to_num(), want_max.nan_to_num())
        assert got_index.dtype == torch.int64 and got_max.dtype == values.dtype
