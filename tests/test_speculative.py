"""Speculative decoding end to end: exact for greedy and seeded requests on the real model with every
sampling option, the target distribution kept for unseeded sampling (a chi-square test against exact
marginals of a tiny random model), and configuration errors that say what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from titan.config import SpeculativeConfig
from titan.config_flags import engine_config
from titan.engine.sampling_params import SamplingParams
from titan.engine.spec.ngram import NgramIndex
from titan.entrypoints.llm import LLM
from titan.loader import load_model_files

PASSAGE = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
           "step. To be or not to be, that is the question. All that glitters is not gold.")
CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n"
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
DRAFT = {"method": "draft_model", "model": "default", "num_speculative_tokens": 3, "adaptive": False}


@pytest.fixture(scope="module")
def engines() -> dict[str, LLM]:
    return {
        "off": LLM(threads=1),
        "fixed": LLM(threads=1, speculative_config={**NGRAM, "adaptive": False}),
        "adaptive": LLM(threads=1, speculative_config=NGRAM),
        # The default model drafting for itself: greedy drafts agree unless penalties or bias steer the target.
        "draft": LLM(threads=1, speculative_config=DRAFT),
    }


def copy_prompts(llm: LLM) -> list[list[int]]:
    chat = llm.tokenizer.encode_chat([{"role": "user", "content": "Repeat this text exactly:\n\n" + PASSAGE}])
    return [chat, llm.tokenizer.encode(CODE), llm.tokenizer.encode(PASSAGE + " " + PASSAGE[:60])]


def option_params(llm: LLM) -> list[SamplingParams]:
    """One request per sampling option that interacts with speculation (all greedy)."""
    the = llm.tokenizer.encode(" the")[-1]
    return [
        SamplingParams(max_tokens=40, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, stop=["miles", "return a *"]),
        SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[the]),
        SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=30, min_tokens=25, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4,
                       frequency_penalty=0.3),
        SamplingParams(max_tokens=40, temperature=0.0, logit_bias={the: -100.0}),
        SamplingParams(max_tokens=40, temperature=0.0, logprobs=3),
    ]


def run_all(llm: LLM, sampling: list[SamplingParams]) -> list:
    prompts = [prompt for prompt in copy_prompts(llm) for _ in sampling]
    return llm.generate(prompts, sampling * len(copy_prompts(llm)))


def test_greedy_output_is_identical_with_every_option(engines: dict[str, LLM]) -> None:
    reference = run_all(engines["off"], option_params(engines["off"]))
    for name in ("fixed", "adaptive", "draft"):
        outputs = run_all(engines[name], option_params(engines[name]))
        for expected, actual in zip(reference, outputs, strict=True):
            assert actual.token_ids == expected.token_ids, name
            assert actual.text == expected.text
            assert (actual.finish_reason, actual.stop_reason) == (expected.finish_reason, expected.stop_reason)
            if expected.logprobs is not None:
                assert len(actual.logprobs) == len(expected.logprobs)
                for a, e in zip(actual.logprobs, expected.logprobs, strict=True):
                    assert a.token_id == e.token_id and abs(a.logprob - e.logprob) < 1e-3
                    assert [t for t, _ in a.top] == [t for t, _ in e.top]
        accepted = sum(output.timeline["accepted_draft_tokens"] for output in outputs)
        drafted = sum(output.timeline["draft_tokens"] for output in outputs)
        assert 0 < accepted <= drafted, name  # speculation really ran
        # ...and was sometimes wrong. Not asked of the adaptive planner: how much it drafts follows the
        # measured step costs, so on a fast or a loaded machine it may draft only what it is sure of (seen:
        # 11 drafted, 11 accepted); the fixed-k and draft engines exercise rejection every run.
        if name != "adaptive":
            assert accepted < drafted, name
        if name == "draft":
            assert accepted > 0.6 * drafted
    # The option that stops on a string stopped on it in every engine, and min_tokens held.
    assert {o.stop_reason for o in reference[1::8]} & {"miles", "return a *"}
    assert all(o.num_output_tokens >= 25 for o in reference[4::8])


def test_preemption_chunked_prefill_and_prefix_hits_in_the_middle_of_speculation(engines: dict[str, LLM]) -> None:
    """Copy prompts through a tiny cache and step budget: drafts are verified while other sequences are
    preempted and prompts are chunked, and every output is the unconstrained run's."""
    sampling = SamplingParams(max_tokens=24, temperature=0.0)
    prompts = copy_prompts(engines["off"]) * 3
    reference = [o.token_ids for o in engines["off"].generate(prompts, sampling)]
    # 4-token blocks, 24-token steps, ~46 blocks for 9 x (up to ~70 + 24) tokens.
    llm = LLM(threads=1, block_size=4, max_num_batched_tokens=24, max_num_seqs=9, kv_cache_memory=0.004,
              speculative_config={**NGRAM, "adaptive": False})
    outputs = llm.generate(prompts, sampling)
    engine = llm.engine
    assert engine.scheduler.num_preemptions > 0, "the cache was sized to force preemption"
    assert engine.block_manager.prefix_cache_hits > 0
    assert engine.stats().spec.num_accepted_tokens > 0
    assert [o.token_ids for o in outputs] == reference
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_seeded_sampling_gives_the_same_tokens_as_without_speculation(engines: dict[str, LLM]) -> None:
    # Three requests: a verify step (3 x 5 rows) stays within the fused kernels' rows, which compute
    # each row alone, so both engines see bit-identical probabilities and exactness is about sampling
    # alone. (A wider step goes through a GEMM whose float summation order differs by ~1e-6, which can
    # move a seeded draw that falls that close to a boundary.)
    sampling = [SamplingParams(max_tokens=32, temperature=0.7, top_p=0.95, top_k=40, seed=seed) for seed in range(3)]
    prompts = copy_prompts(engines["off"])[:3]
    expected = engines["off"].generate(prompts, sampling)
    for name in ("fixed", "draft"):
        actual = engines[name].generate(prompts, sampling)
        assert [o.token_ids for o in actual] == [o.token_ids for o in expected], name
        assert sum(o.timeline["accepted_draft_tokens"] for o in actual) > 0
    again = engines["fixed"].generate(prompts, sampling)
    assert [o.token_ids for o in again] == [o.token_ids for o in expected]


# ---- the distribution of unseeded samples ---------------------------------------------------------

VOCAB = 16


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    """A random 2-layer model over 16 tokens with peaked distributions (drafts are often accepted),
    served with the default model's tokenizer files."""
    folder = tmp_path_factory.mktemp("tiny-spec")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)  # sharpen: logits of a few units, not ~0
    model.save_pretrained(folder)
    source = load_model_files("default", "auto").folder
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(source / name, folder / name)
    return folder, model.eval()


def model_written_prompt(model: LlamaForCausalLM, length: int = 24) -> list[int]:
    """A prompt the model itself would write (sampled at temperature 1), so that prompt lookup finds drafts
    it often accepts, and rejects sometimes."""
    generator = torch.Generator().manual_seed(1)
    tokens = [0]
    with torch.no_grad():
        while len(tokens) < length:
            probs = torch.softmax(model(torch.tensor([tokens])).logits[0, -1].double(), dim=-1)
            tokens.append(int(torch.multinomial(probs, 1, generator=generator)))
    return tokens


def exact_marginals(model: LlamaForCausalLM, prompt: list[int], length: int) -> list[torch.Tensor]:
    """P(output token i = v) for i < length, by enumerating every earlier output."""
    marginals = []
    prefixes, weights = torch.tensor([prompt]), torch.ones(1, dtype=torch.float64)
    with torch.no_grad():
        for _ in range(length):
            probs = torch.softmax(model(prefixes).logits[:, -1].double(), dim=-1)
            joint = weights[:, None] * probs
            marginals.append(joint.sum(dim=0))
            prefixes = torch.cat([prefixes.repeat_interleave(VOCAB, 0),
                                  torch.arange(VOCAB).repeat(prefixes.shape[0])[:, None]], dim=1)
            weights = joint.reshape(-1)
    return marginals


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit; cells expected below 5 are pooled."""
    expected = probs * counts.sum()
    small = expected < 5
    observed = torch.cat([counts[~small], counts[small].sum().unsqueeze(0)]).double()
    expected = torch.cat([expected[~small], expected[small].sum().unsqueeze(0)])
    keep = expected > 0
    observed, expected = observed[keep], expected[keep]
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = observed.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2.0, dtype=torch.float64), statistic / 2.0))


def test_unseeded_samples_follow_the_target_distribution(tiny_model: tuple[Path, LlamaForCausalLM]) -> None:
    folder, model = tiny_model
    prompt = model_written_prompt(model)
    length, samples = 4, 1500
    marginals = exact_marginals(model, prompt, length)
    llm = LLM(str(folder), speculative_config={**NGRAM, "num_speculative_tokens": 3, "adaptive": False},
              max_num_seqs=64, threads=1, slow_request_ms=0)
    sampling = SamplingParams(max_tokens=length, temperature=1.0, ignore_eos=True)
    outputs = llm.generate([prompt] * samples, sampling)
    stats = llm.engine.stats().spec
    assert stats.num_draft_tokens > stats.num_accepted_tokens > samples // 4  # drafts taken, and refused
    tokens = torch.tensor([output.token_ids for output in outputs])
    for position in range(1, length):  # position 0 is sampled before any draft exists
        counts = torch.bincount(tokens[:, position], minlength=VOCAB)
        assert chi_square_p_value(counts, marginals[position]) > 1e-4, position


def test_a_draft_that_is_always_accepted_would_fail_the_distribution_test(
        tiny_model: tuple[Path, LlamaForCausalLM]) -> None:
    """The chi-square test can fail: draft continuations taken unverified do not follow the model."""
    _, model = tiny_model
    prompt = model_written_prompt(model)
    marginals = exact_marginals(model, prompt, 2)
    def draft(tokens: list[int]) -> list[int]:
        index = NgramIndex(NGRAM["prompt_lookup_max"], NGRAM["prompt_lookup_min"])
        index.extend(tokens)
        return index.propose(1)

    first = torch.multinomial(marginals[0].float(), 2000, replacement=True, generator=torch.Generator().manual_seed(0))
    biased = torch.tensor([(draft(prompt + [token]) or [token])[0] for token in first.tolist()])
    assert chi_square_p_value(torch.bincount(biased, minlength=VOCAB), marginals[1]) < 1e-4


# ---- configuration --------------------------------------------------------------------------------

def test_draft_model_frees_its_cache_and_refuses_another_vocabulary(
        engines: dict[str, LLM], tiny_model: tuple[Path, LlamaForCausalLM]) -> None:
    drafter = engines["draft"].engine.drafter
    assert drafter.block_manager.num_free_blocks == drafter.block_manager.num_blocks  # every request finished
    assert drafter.shadows == {} or all(s.seq.block_table == [] for s in drafter.shadows.values())
    folder, _ = tiny_model
    with pytest.raises(ValueError, match="vocabulary of 16 tokens, the served model 49152"):
        LLM(threads=1, speculative_config={**DRAFT, "model": str(folder)})


def test_speculative_config_parses_vllm_keys_and_rejects_mistakes() -> None:
    config = engine_config(speculative_config=json.dumps(NGRAM)).speculative_config
    assert config == SpeculativeConfig("ngram", 4, 4, 1)
    for bad, message in (
        ({"method": "eagle"}, "speculative method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "between 1 and 16"),
        ({"method": "ngram", "prompt_lookup_min": 5, "prompt_lookup_max": 3}, "prompt_lookup_min"),
        ({"method": "ngram", "k": 3}, "unknown speculative_config key"),
        ({"method": "draft_model"}, "needs \"model\""),
        ({"num_speculative_tokens": 3}, "needs \"method\""),
    ):
        with pytest.raises(ValueError, match=message):
            engine_config(speculative_config=bad)
    with pytest.raises(ValueError, match="not valid JSON"):
        engine_config(speculative_config="{method: ngram}")
