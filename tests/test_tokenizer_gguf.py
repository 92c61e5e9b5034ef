"""GGUF tokenizer metadata -> tokenizer.json / tokenizer_config.json, checked against transformers."""

from __future__ import annotations

import json
import pathlib
import time

import gguf
import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models, normalizers, pre_tokenizers, trainers

from titan.loader.resolve import default_model_path
from titan.tokenizer import Tokenizer
from titan.tokenizer.gguf_convert import write_tokenizer_files

DEFAULT_GGUF = default_model_path()  # found through importlib.metadata: this file once named one checkout's venv

TEXTS = [
    "Hello world! How are you today?",
    "你好，世界！今天天气很好。我们去公园散步吧。",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "emoji 🤗🎉👍🏽 and flags 🇫🇷 mixed👨‍👩‍👧 in",
    "   leading spaces, trailing spaces   ",
    "tabs\t\tand\nnew\n\n\nlines\r\nwindows",
    "digits 1234567890, pi=3.14159, year 2024, 42nd",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "It's a dog's life; they're sure we'll win, I'd say.",
    "naïve café résumé Ångström ÿ",
    "ＡＢＣ１２３ full-width",
    "",
    " ",
    "x",
]


@pytest.fixture(scope="module")
def default_reader() -> gguf.GGUFReader:
    return gguf.GGUFReader(DEFAULT_GGUF)


@pytest.fixture(scope="module")
def small_vocab(default_reader) -> dict[str, list]:
    """The first 8192 SmolLM2 tokens and the merges among them: a real byte-level vocabulary that is
    quick to write into and read back from test GGUFs (gguf's reader is slow on long string arrays)."""
    size = 8192
    tokens = default_reader.fields["tokenizer.ggml.tokens"].contents()[:size]
    token_types = default_reader.fields["tokenizer.ggml.token_type"].contents()[:size]
    known = set(tokens)
    merges = [merge for merge in default_reader.fields["tokenizer.ggml.merges"].contents()
              if merge.replace(" ", "") in known and all(part in known for part in merge.split(" "))]
    return {"tokens": tokens, "token_types": token_types, "merges": merges}


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory, default_reader) -> tuple[pathlib.Path, float]:
    out_dir = tmp_path_factory.mktemp("smollm2-tokenizer")
    start = time.perf_counter()
    write_tokenizer_files(default_reader, out_dir)
    return out_dir, time.perf_counter() - start


@pytest.fixture(scope="module")
def reference():
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(DEFAULT_GGUF.parent), gguf_file=DEFAULT_GGUF.name)


def write_gguf(path: pathlib.Path, *, model: str, pre: str | None, tokens: list[str], token_types: list[int],
               merges: list[str] | None = None, scores: list[float] | None = None, bos: int | None = None,
               eos: int | None = None, unk: int | None = None, add_bos: bool | None = None,
               extra: dict[str, int] | None = None) -> None:
    """A metadata-only GGUF (no tensors) describing a tokenizer."""
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_context_length(128)
    writer.add_embedding_length(16)
    writer.add_block_count(1)
    writer.add_feed_forward_length(32)
    writer.add_head_count(2)
    writer.add_tokenizer_model(model)
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    if merges is not None:
        writer.add_token_merges(merges)
    if scores is not None:
        writer.add_token_scores(scores)
    special_ids = ((bos, writer.add_bos_token_id), (eos, writer.add_eos_token_id),
                   (unk, writer.add_unk_token_id))
    for value, add in special_ids:
        if value is not None:
            add(value)
    if add_bos is not None:
        writer.add_add_bos_token(add_bos)
    for key, value in (extra or {}).items():
        writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_default_gguf_matches_transformers(converted, reference) -> None:
    out_dir, _ = converted
    tokenizer = Tokenizer.from_folder(out_dir)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids, skip_special_tokens=False) == text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)


def test_special_tokens_encode_as_single_ids(converted) -> None:
    tokenizer = Tokenizer.from_folder(converted[0])
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("a<|im_end|>b", add_special_tokens=False)[1] == 2
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_smollm_splits_digits_like_llama_cpp(converted, reference) -> None:
    """`smollm` splits every digit before the GPT-2 regex (llama.cpp, and SmolLM2's own tokenizer.json:
    Digits + ByteLevel). transformers' GGUF loader uses the plain GPT-2 regex, which differs only for a
    whitespace run before a digit; with the digit split swapped in, it agrees with us everywhere."""
    tokenizer = Tokenizer.from_folder(converted[0])
    text = "a  1 and x   22 yy"
    ids = tokenizer.encode(text)
    assert tokenizer.decode(ids) == text
    assert ids != reference.encode(text)
    assert [tokenizer.id_to_token(i) for i in ids[:3]] == ["a", "ĠĠ", "1"]

    backend = BackendTokenizer.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    for sample in [*TEXTS, text, "\n\n 7", "1 2  3   4"]:
        assert tokenizer.encode(sample) == backend.encode(sample).ids, sample


def test_config_files(converted) -> None:
    out_dir, _ = converted
    config = json.loads((out_dir / "tokenizer_config.json").read_text())
    assert config["bos_token"] == "<|im_start|>"
    assert config["eos_token"] == "<|im_end|>"
    assert config["pad_token"] == "<|im_end|>"
    assert config["add_bos_token"] is False
    assert "<|im_start|>" in config["chat_template"]
    generation = json.loads((out_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == 2
    tokenizer = Tokenizer.from_folder(out_dir)
    assert tokenizer.bos_token_id == 1
    assert tokenizer.eos_token_ids == frozenset({2})
    assert tokenizer.vocab_size == 49152


def test_converted_tokenizer_loads_again(converted) -> None:
    # How long conversion and loading take is a benchmark's business; here only that a second load works.
    out_dir, write_seconds = converted
    start = time.perf_counter()
    tokenizer = Tokenizer.from_folder(out_dir)
    print(f"write_tokenizer_files {write_seconds:.3f}s, Tokenizer.from_folder {time.perf_counter() - start:.3f}s")
    assert tokenizer.decode(tokenizer.encode("Hello, world")) == "Hello, world"


@pytest.mark.parametrize("pre", ["llama-bpe", "qwen2", "gpt2"])
def test_pre_tokenizer_variants_match_transformers(tmp_path, small_vocab, pre: str) -> None:
    """The SmolLM2 vocabulary relabelled with other pre-tokenizer tags: each must split like
    transformers does for that tag (the regexes of Llama 3, Qwen2 and GPT-2)."""
    transformers = pytest.importorskip("transformers")
    write_gguf(tmp_path / "model.gguf", model="gpt2", pre=pre, **small_vocab, bos=1, eos=2, add_bos=False)
    write_tokenizer_files(gguf.GGUFReader(tmp_path / "model.gguf"), tmp_path / "converted")
    tokenizer = Tokenizer.from_folder(tmp_path / "converted")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    for text in [*TEXTS, "a  1 and x   22 yy", "12345678 ab\n\n\n  cd"]:
        ids = tokenizer.encode(text)
        assert ids == reference.encode(text), (pre, text)
        assert tokenizer.decode(ids, skip_special_tokens=False) == text


def test_llama3_adds_bos_once(tmp_path, small_vocab) -> None:
    """Llama 3 files add BOS; a chat template that writes BOS itself must not end up with two."""
    write_gguf(tmp_path / "model.gguf", model="gpt2", pre="llama-bpe", **small_vocab, bos=1, eos=2)
    write_tokenizer_files(gguf.GGUFReader(tmp_path / "model.gguf"), tmp_path)
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.encode("hello")[0] == 1
    assert tokenizer.encode("<|im_start|>hello") == tokenizer.encode("hello")
    assert tokenizer.encode("hello", add_special_tokens=False)[0] != 1


def test_end_of_turn_ids_join_generation_config(tmp_path) -> None:
    tokens = ["<|end_of_text|>", "<|begin_of_text|>", "<|eot_id|>", "a", "b", "ab"]
    write_gguf(tmp_path / "model.gguf", model="gpt2", pre="llama-bpe", tokens=tokens,
               token_types=[3, 3, 3, 1, 1, 1], merges=["a b"], bos=1, eos=0)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 0, "temperature": 0.6}))
    write_tokenizer_files(gguf.GGUFReader(tmp_path / "model.gguf"), tmp_path)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [0, 2]
    assert generation["temperature"] == 0.6
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.eos_token_ids == frozenset({0, 2})
    assert tokenizer.encode("ab") == [1, 5]


def _sentencepiece_vocabulary() -> tuple[list[str], list[int], list[float]]:
    """A small Llama-2-style vocabulary: <unk> <s> </s>, 256 byte tokens, then `▁` pieces whose scores
    encode a BPE merge order learned from a tiny corpus."""
    corpus = ["The quick brown fox jumps over the lazy dog.", "Hello world, this is a test of tokenizers.",
              "def main():\n    print('hello')\n    return 0", "She sells sea shells by the sea shore."] * 10
    trainer_model = BackendTokenizer(models.BPE())
    trainer_model.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer_model.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_next")
    trainer_model.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = json.loads(trainer_model.to_str())["model"]
    merged = ["".join(pair) for pair in learned["merges"]]
    alphabet = [token for token in learned["vocab"] if token not in set(merged)]
    tokens = ["<unk>", "<s>", "</s>", *[f"<0x{byte:02X}>" for byte in range(256)]]
    types = [2, 3, 3, *[6] * 256]
    scores = [0.0] * len(tokens)
    for rank, piece in enumerate(merged):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    for rank, piece in enumerate(alphabet):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(len(merged) + rank))
    return tokens, types, scores


def test_sentencepiece_vocab_matches_transformers(tmp_path) -> None:
    transformers = pytest.importorskip("transformers")
    tokens, types, scores = _sentencepiece_vocabulary()
    write_gguf(tmp_path / "model.gguf", model="llama", pre=None, tokens=tokens, token_types=types,
               scores=scores, bos=1, eos=2, unk=0)
    write_tokenizer_files(gguf.GGUFReader(tmp_path / "model.gguf"), tmp_path / "converted")
    tokenizer = Tokenizer.from_folder(tmp_path / "converted")
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="model.gguf")
    # Texts start with a non-space and hold no special tokens: there transformers' Metaspace and
    # llama.cpp's per-run space prefix (which we follow) agree.
    samples = ["The quick brown fox", "Hello world, this is a test.", "def main():\n    return 0",
               "中文 and emoji 🤗 fall back to bytes", "tabs\tand  double  spaces", "x"]
    for text in samples:
        ids = tokenizer.encode(text)
        assert ids[0] == 1
        assert ids == reference.encode(text), text
        assert tokenizer.decode(ids) == text
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
    assert tokenizer.id_to_token(tokenizer.encode("中", add_special_tokens=False)[-1]).startswith("<0x")
    # Leading spaces survive a round trip (sentencepiece adds its dummy prefix even before a space).
    assert tokenizer.decode(tokenizer.encode("  indented")) == "  indented"
    # A text run after a special token gets the dummy prefix too, as llama.cpp does.
    after_special = tokenizer.encode("</s>hello", add_special_tokens=False)
    assert after_special == [2, *tokenizer.encode("hello", add_special_tokens=False)]


def test_transformers_saved_copy_loads_the_same(tmp_path, converted, reference) -> None:
    """transformers' own save of the GGUF tokenizer (template in chat_template.jinja) loads like ours,
    except for the digit split explained above."""
    reference.save_pretrained(tmp_path)
    saved = Tokenizer.from_folder(tmp_path)
    ours = Tokenizer.from_folder(converted[0])
    assert saved.chat_template == ours.chat_template
    messages = [{"role": "user", "content": "Hi there"}]
    assert saved.apply_chat_template(messages) == ours.apply_chat_template(messages)
    assert (saved.bos_token_id, saved.eos_token_ids, saved.vocab_size) == (1, frozenset({2}), 49152)
    for text in TEXTS:
        assert saved.encode(text) == ours.encode(text) == reference.encode(text)
