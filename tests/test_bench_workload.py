"""`titan bench` workloads: lengths, token counting, presets, JSONL, determinism."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from tokenizers import decoders as token_decoders

from titan.bench.workload import (
    PRESETS,
    WORDS,
    LengthDistribution,
    TokenCounter,
    Workload,
    WorkloadOptions,
    load_dataset,
)


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small byte-level BPE trained on the filler words (stands in for a served model's tokenizer)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = token_decoders.ByteLevel()
    rng = random.Random(0)
    corpus = [" ".join(rng.choice(WORDS) for _ in range(50)) for _ in range(200)]
    tokenizer.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=2000, show_progress=False,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_length_distributions() -> None:
    rng = random.Random(1)
    assert LengthDistribution.parse("128").sample(rng) == 128
    uniform = LengthDistribution.parse("10:20")
    draws = [uniform.sample(rng) for _ in range(2000)]
    assert min(draws) == 10 and max(draws) == 20 and uniform.mean == 15
    exponential = LengthDistribution.parse("exp:50")
    draws = [exponential.sample(rng) for _ in range(5000)]
    assert 1 <= min(draws) and max(draws) <= 400
    assert sum(draws) / len(draws) == pytest.approx(50, rel=0.08)
    assert [str(LengthDistribution.parse(text)) for text in ("7", "3:9", "exp:5")] == ["7", "3:9", "exp:5"]
    for bad in ("", "0", "abc", "9:3", "exp:x", "-5"):
        with pytest.raises(ValueError):
            LengthDistribution.parse(bad)


def test_estimated_counting_and_text_length() -> None:
    counter = TokenCounter()
    assert not counter.exact
    assert counter.count("") == 0 and counter.count("abcdefgh") == 2
    text = counter.make_text(random.Random(2), 100)
    assert counter.count_filler(text) == len(text.split()) == 100  # one common word is one token


def test_filler_words_are_single_tokens(tokenizer_file: Path) -> None:
    # The claim behind counting filler without a tokenizer, checked on a byte-level BPE.
    counter = TokenCounter(str(tokenizer_file))
    text = TokenCounter().make_text(random.Random(3), 200)
    assert counter.count(text) == pytest.approx(200, rel=0.1)


def test_tokenizer_counting_is_exact(tokenizer_file: Path) -> None:
    counter = TokenCounter(str(tokenizer_file))
    assert counter.exact
    for size in (1, 17, 300):
        text = counter.make_text(random.Random(size), size)
        assert counter.count(text) == pytest.approx(size, abs=1)


def test_requests_are_deterministic_per_seed_and_index() -> None:
    first = Workload(WorkloadOptions(preset="prefill-storm", seed=5))
    second = Workload(WorkloadOptions(preset="prefill-storm", seed=5))
    other = Workload(WorkloadOptions(preset="prefill-storm", seed=6))
    assert [first.request(i) for i in range(20)] == [second.request(i) for i in reversed(range(20))][::-1]
    assert first.request(3) != other.request(3)


def test_prefill_storm_and_mixed_priority_classes() -> None:
    storm = Workload(WorkloadOptions(preset="prefill-storm", long_input_len=LengthDistribution.fixed(1000)))
    specs = [storm.request(i) for i in range(1000)]
    long_specs = [s for s in specs if s.request_class == "long-prefill"]
    assert 60 <= len(long_specs) <= 140  # 10% of 1000
    assert all(s.input_tokens == pytest.approx(1000, abs=1) and s.max_tokens == 16 for s in long_specs)
    short = [s for s in specs if s.request_class == "interactive"]
    assert all(63 <= s.input_tokens <= 129 and s.max_tokens == 64 for s in short)
    mixed = Workload(WorkloadOptions(preset="mixed-priority", batch_fraction=0.5, endpoint="chat"))
    specs = [mixed.request(i) for i in range(400)]
    batch = [s for s in specs if s.request_class == "batch"]
    assert 160 <= len(batch) <= 240
    assert {s.priority for s in batch} == {1} and {s.priority for s in specs if s not in batch} == {0}
    assert all(s.prompt is None and s.messages[0]["role"] == "user" for s in specs)


def test_overrides_and_fractions() -> None:
    workload = Workload(WorkloadOptions(preset="steady", input_len=LengthDistribution.fixed(40),
                                        output_len=LengthDistribution.parse("5:6")))
    spec = workload.request(0)
    assert spec.input_tokens == pytest.approx(40, abs=1) and spec.max_tokens in (5, 6)
    assert spec.prompt is not None and spec.messages is None
    storm = Workload(WorkloadOptions(preset="prefill-storm", long_fraction=1.0,
                                     long_output_len=LengthDistribution.fixed(3)))
    assert {(s.request_class, s.max_tokens) for s in map(storm.request, range(20))} == {("long-prefill", 3)}
    mixed = Workload(WorkloadOptions(preset="mixed-priority", batch_fraction=1.0,
                                     batch_input_len=LengthDistribution.fixed(30),
                                     batch_output_len=LengthDistribution.fixed(7)))
    assert {(s.request_class, s.input_tokens, s.max_tokens) for s in map(mixed.request, range(20))} == {
        ("batch", 30, 7)}
    with pytest.raises(ValueError):
        Workload(WorkloadOptions(preset="prefill-storm", long_fraction=1.5))
    with pytest.raises(ValueError):
        Workload(WorkloadOptions(preset="nope"))
    assert set(PRESETS) == {"steady", "burst", "prefill-storm", "shared-prefix", "mixed-priority"}


def test_shared_prefix_prompts_share_their_start(tokenizer_file: Path) -> None:
    workload = Workload(WorkloadOptions(preset="shared-prefix", prefix_len=200, num_prefixes=2, seed=1),
                        TokenCounter(str(tokenizer_file)))
    prompts = [workload.request(i).prompt for i in range(20)]
    used = {prefix for prompt in prompts for prefix in workload.prefixes if prompt.startswith(prefix)}
    assert used == set(workload.prefixes) and len(used) == 2
    assert len(set(prompts)) == 20
    spec = workload.request(0)
    assert spec.input_tokens == pytest.approx(200 + 64, abs=3)
    chat = Workload(WorkloadOptions(preset="shared-prefix", prefix_len=50, endpoint="chat")).request(0)
    assert chat.messages[0]["role"] == "system" and chat.messages[1]["role"] == "user"
    assert workload.describe()["num_prefixes"] == 2


def test_jsonl_dataset(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "Tell me a story", "max_tokens": 7, "class": "story"},
        {"messages": [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hi"}]},
        {"conversations": [{"from": "human", "value": "Q1"}, {"from": "gpt", "value": "A1"},
                           {"from": "human", "value": "Q2"}, {"from": "gpt", "value": "A2"}]},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n", encoding="utf-8")
    assert len(load_dataset(str(path))) == 3
    completions = Workload(WorkloadOptions(dataset=str(path), output_len=LengthDistribution.fixed(9)))
    specs = [completions.request(i) for i in range(4)]
    assert (specs[0].prompt, specs[0].max_tokens, specs[0].request_class) == ("Tell me a story", 7, "story")
    assert specs[1].prompt == "system: Be brief\nuser: Hi" and specs[1].max_tokens == 9
    assert specs[3].prompt == specs[0].prompt  # the file repeats when more requests are asked for
    chat = Workload(WorkloadOptions(dataset=str(path), endpoint="chat"))
    assert chat.request(0).messages == [{"role": "user", "content": "Tell me a story"}]
    assert [m["content"] for m in chat.request(2).messages] == ["Q1", "A1", "Q2"]
    for bad in ("not json", "[1, 2]", '{"text": "x"}', ""):
        path.write_text(bad, encoding="utf-8")
        with pytest.raises(ValueError):
            load_dataset(str(path))


def test_the_bench_never_imports_torch_or_the_engine() -> None:
    # A client for any OpenAI server: importing all of it (and building the CLI) must stay light.
    code = ("import sys; import titan.bench.cli, titan.bench.runner, titan.bench.report, titan.bench.plots; "
            "from titan.entrypoints.cli import build_parser; build_parser(); "
            "heavy = [m for m in ('torch', 'titan.engine', 'titan.server.app', 'transformers') if m in sys.modules]; "
            "print(heavy); sys.exit(1 if heavy else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
