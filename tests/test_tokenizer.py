"""`Tokenizer.from_folder` on HF-layout folders written by transformers, checked against transformers."""

from __future__ import annotations

import json
import pathlib

import pytest
from tokenizers import AddedToken, decoders, models, pre_tokenizers, processors, trainers
from tokenizers import Tokenizer as BackendTokenizer

from titan.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello world! Tokenizers turn text into numbers and back again.",
    "def add(a, b):\n    return a + b\n",
    "数字 123 和 emoji 🤗 也要能处理。",
] * 5
SAMPLES = ["Hello world!", "def add(a, b):\n    return a + b", "数字 123 🤗", "  spaced   out  ", ""]
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '[' + message['role'] + '] ' + message['content'] + eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant] ' }}{% endif %}"
)


def build_backend() -> BackendTokenizer:
    """A tiny byte-level BPE with a Llama-style post-processor that adds `<s>`."""
    backend = BackendTokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", "<|eot|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    backend.add_tokens([AddedToken("<think>", special=False, normalized=False)])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", backend.token_to_id("<s>"))]
    )
    return backend


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    folder = tmp_path_factory.mktemp("hf-tokenizer")
    reference = transformers.PreTrainedTokenizerFast(
        tokenizer_object=build_backend(), bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    reference.chat_template = TEMPLATE
    reference.save_pretrained(folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 3], "bos_token_id": 1}))
    model_config = {"eos_token_id": 2, "architectures": ["LlamaForCausalLM"]}
    (folder / "config.json").write_text(json.dumps(model_config))
    return folder


@pytest.fixture(scope="module")
def reference(hf_folder: pathlib.Path):
    return transformers.AutoTokenizer.from_pretrained(hf_folder)


def test_from_folder_matches_transformers(hf_folder, reference) -> None:
    tokenizer = Tokenizer.from_folder(hf_folder)
    for text in [*SAMPLES, "<think>why</think> <|eot|>"]:
        for add_special_tokens in (True, False):
            ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
            assert ids == reference.encode(text, add_special_tokens=add_special_tokens), text
        ids = tokenizer.encode(text)
        assert tokenizer.decode(ids) == reference.decode(ids, skip_special_tokens=True)
        assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(ids)
        assert tokenizer.decode(ids) == text.replace("<|eot|>", "")
    assert tokenizer.bos_token_id == reference.bos_token_id == 1
    assert tokenizer.eos_token_id == reference.eos_token_id == 2
    assert tokenizer.vocab_size == len(reference)
    assert tokenizer.id_to_token(5) == reference.convert_ids_to_tokens(5)
    assert tokenizer.id_to_token(10**6) is None


def test_chat_template_read_from_saved_folder(hf_folder, reference) -> None:
    tokenizer = Tokenizer.from_folder(hf_folder)
    assert tokenizer.chat_template == TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    prompt = tokenizer.apply_chat_template(messages)
    assert prompt == reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.startswith("<s>[system]")
    # The template writes BOS; encoding the prompt must not add a second one.
    ids = tokenizer.encode(prompt)
    assert ids[:2] == [1, tokenizer.encode("[", add_special_tokens=False)[0]]
    # encode_chat is exactly that, and agrees with transformers' tokenized template.
    assert tokenizer.encode_chat(messages) == ids
    assert ids == reference.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                return_dict=False)
    assert ids[1:] == tokenizer.encode(prompt[len("<s>"):], add_special_tokens=False)


def test_eos_ids_gathered_from_all_configs(hf_folder) -> None:
    tokenizer = Tokenizer.from_folder(hf_folder)
    assert tokenizer.eos_token_ids == frozenset({2, 3})


def test_add_bos_token_without_post_processor(tmp_path) -> None:
    backend = build_backend()
    backend.post_processor = None
    backend.save(str(tmp_path / "tokenizer.json"))
    config = {"bos_token": {"content": "<s>", "special": True}, "eos_token": "</s>", "add_bos_token": True,
              "add_eos_token": True}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = Tokenizer.from_folder(tmp_path)
    plain = tokenizer.encode("Hello", add_special_tokens=False)
    assert tokenizer.encode("Hello") == [1, *plain, 2]
    assert tokenizer.encode("<s>Hello") == [1, *plain, 2]
    assert tokenizer.encode("Hello</s>") == [1, *plain, 2]


def test_named_templates_and_chat_template_json(tmp_path) -> None:
    build_backend().save(str(tmp_path / "tokenizer.json"))
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "chat"}]
    config = {"chat_template": named}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert Tokenizer.from_folder(tmp_path).chat_template == "chat"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    assert Tokenizer.from_folder(tmp_path).chat_template is None
    (tmp_path / "chat_template.json").write_text(json.dumps({"chat_template": "from json"}))
    assert Tokenizer.from_folder(tmp_path).chat_template == "from json"


def test_missing_template_raises(tmp_path) -> None:
    build_backend().save(str(tmp_path / "tokenizer.json"))
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.bos_token_id is None and tokenizer.eos_token_ids == frozenset()
    with pytest.raises(ValueError, match="no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                             chat_template="{{ messages[0].content }}")
    assert rendered == "hi"


def test_missing_tokenizer_json(tmp_path) -> None:
    with pytest.raises(FileNotFoundError):
        Tokenizer.from_folder(tmp_path)


def test_decode_ignores_ids_beyond_vocabulary(hf_folder) -> None:
    # Models often have more embedding rows than tokens; sampling one must not crash decoding.
    tokenizer = Tokenizer.from_folder(hf_folder)
    ids = tokenizer.encode("Hello", add_special_tokens=False)
    assert tokenizer.decode([*ids, tokenizer.vocab_size + 7]) == "Hello"
