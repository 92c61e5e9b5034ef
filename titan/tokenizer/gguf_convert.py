"""Rebuild an HF-style tokenizer (`tokenizer.json` + `tokenizer_config.json`) from GGUF metadata.

A GGUF carries the vocabulary, merges and special-token ids under llama.cpp's key names, and names the
pre-tokenizer only by a tag (`tokenizer.ggml.pre`). We map that tag to the split rules llama.cpp applies
for it, so the ids we produce match what the model saw in training (and what llama.cpp produces).
"""

from __future__ import annotations

import json
import logging
import pathlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import BPE

if TYPE_CHECKING:
    import gguf

logger = logging.getLogger(__name__)

# llama.cpp token types (gguf.TokenType).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

SPIECE_SPACE = "\u2581"

# Split regexes, as published in the `tokenizer.json` of the model families that use them.
GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_UPPER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]"
_LOWER = r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
TEKKEN_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_CONTRACTION = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
GPT4O_SPLIT = (
    rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTION}"
    rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTION}"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# `tokenizer.ggml.pre` tag -> split style (the grouping follows llama.cpp's llama-vocab.cpp).
_PRE_STYLES: dict[str, str] = {
    **dict.fromkeys(("gpt2", "gpt-2", "default", "phi-2", "mpt", "olmo", "jais", "jina-es", "jina-de",
                     "jina-v2-es", "jina-v2-de", "jina-v1-en", "jina-v2-code", "roberta-bpe", "gigachat",
                     "exaone4", "mellum", "modern-bert", "trillion", "granite-docling"), "gpt2"),
    **dict.fromkeys(("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
                     "mellum2"), "digits+gpt2"),
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
                     "lfm2", "jina-v5-nano"), "llama3"),
    **dict.fromkeys(("dbrx", "smaug-bpe", "chatglm-bpe", "glm4"), "llama3-merges"),
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
                     "solar-open", "grok-2"), "qwen2"),
    "qwen35": "qwen35",
    "tekken": "tekken",
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), "gpt4o"),
}
_STYLE_SPLITS = {
    "llama3": LLAMA3_SPLIT, "llama3-merges": LLAMA3_SPLIT, "qwen2": QWEN2_SPLIT, "qwen35": QWEN35_SPLIT,
    "tekken": TEKKEN_SPLIT, "gpt4o": GPT4O_SPLIT,
}
# llama.cpp matches a whole word against the vocabulary before merging for these (`ignore_merges`).
_IGNORE_MERGES_STYLES = {"llama3", "tekken"}
# ...and adds BOS for these unless the file says otherwise.
_ADD_BOS_STYLES = {"llama3", "tekken"}
# Tokens llama.cpp treats as end-of-turn even when the file names no `eot_token_id`.
_END_OF_TURN_TEXTS = ("<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")


def write_tokenizer_files(reader: gguf.GGUFReader, out_dir: pathlib.Path) -> None:
    """Write `tokenizer.json`, `tokenizer_config.json` and the EOS ids of `generation_config.json`."""
    metadata = _TokenizerMetadata(reader)
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if metadata.model == "gpt2":
        backend, add_bos = _byte_level_bpe(metadata)
    elif metadata.model == "llama":
        backend, add_bos = _sentencepiece_bpe(metadata)
    else:
        raise ValueError(f"unsupported GGUF tokenizer model {metadata.model!r}; supported: gpt2, llama")

    add_bos = metadata.get("tokenizer.ggml.add_bos_token", add_bos)
    add_eos = metadata.get("tokenizer.ggml.add_eos_token", False)
    bos_token = metadata.token_text("tokenizer.ggml.bos_token_id")
    eos_token = metadata.token_text("tokenizer.ggml.eos_token_id")
    if add_bos and bos_token is None:
        add_bos = False
    if add_eos and eos_token is None:
        add_eos = False
    backend.post_processor = _post_processor(backend, bos_token if add_bos else None,
                                             eos_token if add_eos else None)
    backend.save(str(out_dir / "tokenizer.json"))

    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos_token,
        "eos_token": eos_token,
        "unk_token": metadata.token_text("tokenizer.ggml.unknown_token_id"),
        "pad_token": metadata.token_text("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(add_bos),
        "add_eos_token": bool(add_eos),
        # Decoding must round-trip text exactly (and stream), so no space clean-up.
        "clean_up_tokenization_spaces": False,
        "chat_template": metadata.get("tokenizer.chat_template"),
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
    _merge_generation_config(out_dir / "generation_config.json", metadata)


class _TokenizerMetadata:
    """The tokenizer keys of a GGUF, read once into plain Python values."""

    def __init__(self, reader: gguf.GGUFReader) -> None:
        self._values: dict[str, Any] = {}
        for name, field in reader.fields.items():
            if name.startswith("tokenizer."):
                self._values[name] = field.contents()
        tokens = self._values.get("tokenizer.ggml.tokens")
        if not tokens:
            raise ValueError("GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens)")
        self.tokens: list[str] = tokens
        self.model: str = self._values.get("tokenizer.ggml.model", "")
        self.pre: str = self._values.get("tokenizer.ggml.pre") or "default"
        token_types = self._values.get("tokenizer.ggml.token_type")
        self.token_types: list[int] = list(token_types) if token_types else [NORMAL] * len(tokens)
        self.scores: list[float] | None = self._values.get("tokenizer.ggml.scores")
        self.merges: list[str] | None = self._values.get("tokenizer.ggml.merges")

    def get(self, key: str, default: Any = None) -> Any:
        return self._values.get(key, default)

    def token_id(self, key: str) -> int | None:
        token_id = self._values.get(key)
        if token_id is None or not 0 <= int(token_id) < len(self.tokens):
            return None
        return int(token_id)

    def token_text(self, key: str) -> str | None:
        token_id = self.token_id(key)
        return None if token_id is None else self.tokens[token_id]


def byte_level_alphabet() -> dict[int, str]:
    """GPT-2's byte -> printable character table (bytes that print as themselves keep their character)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    table = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in table:
            table[byte] = chr(256 + extra)
            extra += 1
    return table


def _byte_level_bpe(metadata: _TokenizerMetadata) -> tuple[BackendTokenizer, bool]:
    alphabet = byte_level_alphabet()
    spelled = set(alphabet.values())
    vocab: dict[str, int] = {}
    for index, (token, token_type) in enumerate(zip(metadata.tokens, metadata.token_types, strict=False)):
        # Added tokens keep their literal text; a normal token written in raw UTF-8 (not the byte
        # alphabet) is respelled so BPE can reach it.
        if token_type not in (CONTROL, USER_DEFINED) and not set(token) <= spelled:
            token = "".join(alphabet[byte] for byte in token.encode("utf-8"))
        vocab.setdefault(token, index)
    if metadata.merges is None:
        raise ValueError("byte-level GGUF tokenizer has no merges (tokenizer.ggml.merges)")
    merges = [_split_merge(merge) for merge in metadata.merges]

    style = _PRE_STYLES.get(metadata.pre)
    if style is None:
        logger.warning("unknown GGUF pre-tokenizer %r; splitting text like GPT-2", metadata.pre)
        style = "gpt2"
    backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                   ignore_merges=style in _IGNORE_MERGES_STYLES))
    if style in _STYLE_SPLITS:
        backend.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_STYLE_SPLITS[style]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    else:
        steps: list[pre_tokenizers.PreTokenizer] = [pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                              use_regex=True)]
        if style == "digits+gpt2":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
    backend.decoder = decoders.ByteLevel()
    _add_special_tokens(backend, metadata)
    return backend, style in _ADD_BOS_STYLES


def _split_merge(merge: str) -> tuple[str, str]:
    # The separator is the first space after position 0, as llama.cpp reads it.
    position = merge.find(" ", 1)
    if position < 0:
        raise ValueError(f"malformed GGUF merge {merge!r}")
    return merge[:position], merge[position + 1:]


def _sentencepiece_bpe(metadata: _TokenizerMetadata) -> tuple[BackendTokenizer, bool]:
    """A SentencePiece-BPE vocabulary (Llama 2, Mistral v0.1...): scores, `<0xNN>` byte fallback, `▁`."""
    tokens = metadata.tokens
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    if metadata.merges is not None:
        merges = [_split_merge(merge) for merge in metadata.merges]
    else:
        scores = metadata.scores or [0.0] * len(tokens)
        merges = _merges_from_scores(tokens, metadata.token_types, scores, vocab)
    unk_token = metadata.token_text("tokenizer.ggml.unknown_token_id")
    backend = BackendTokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk_token, fuse_unk=True,
                                   byte_fallback=True))
    # llama.cpp (like the original sentencepiece usage) puts a space in front of every text run that
    # starts the input or follows a special token; a normalizer runs per such run, so it matches.
    steps = [normalizers.Replace(" ", SPIECE_SPACE)]
    add_space_prefix = metadata.get("tokenizer.ggml.add_space_prefix", True)
    if add_space_prefix:
        steps.insert(0, normalizers.Prepend(SPIECE_SPACE))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    _add_special_tokens(backend, metadata)
    return backend, True


def _merges_from_scores(tokens: Sequence[str], token_types: Sequence[int], scores: Sequence[float],
                        vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece merges the adjacent pair whose joined piece scores highest; as BPE ranks that is
    every (left, right) split of a piece, ordered by the piece's score."""
    ranked: list[tuple[float, int, int, int, str, str]] = []
    for index, token in enumerate(tokens):
        if token_types[index] not in (NORMAL, USER_DEFINED) or len(token) < 2:
            continue
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            left_id, right_id = vocab.get(left), vocab.get(right)
            if left_id is not None and right_id is not None:
                ranked.append((-scores[index], index, left_id, right_id, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _add_special_tokens(backend: BackendTokenizer, metadata: _TokenizerMetadata) -> None:
    """Control and unknown tokens become special added tokens, user-defined ones plain added tokens, so
    text like `<|im_start|>` encodes as one id. Their ids come from the vocabulary, where each sits."""
    special, plain = [], []
    for token, token_type in zip(metadata.tokens, metadata.token_types, strict=False):
        if token_type in (CONTROL, UNKNOWN):
            special.append(AddedToken(token, special=True, normalized=False))
        elif token_type == USER_DEFINED:
            plain.append(AddedToken(token, special=False, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if plain:
        backend.add_tokens(plain)


def _post_processor(backend: BackendTokenizer, bos_token: str | None,
                    eos_token: str | None) -> processors.PostProcessor | None:
    if bos_token is None and eos_token is None:
        return None
    prefix = [bos_token] if bos_token is not None else []
    suffix = [eos_token] if eos_token is not None else []
    single = " ".join([*prefix, "$A", *suffix])
    pair = " ".join([*prefix, "$A", *suffix, *prefix, "$B:1", *suffix])
    special_tokens = [(token, backend.token_to_id(token)) for token in {*prefix, *suffix}]
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=special_tokens)


def _merge_generation_config(path: pathlib.Path, metadata: _TokenizerMetadata) -> None:
    """Record every id that ends generation (EOS, end-of-turn, end-of-message) as HF does, keeping
    whatever else a `generation_config.json` written by the loader already holds."""
    end_ids: list[int] = []
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
        token_id = metadata.token_id(key)
        if token_id is not None and token_id not in end_ids:
            end_ids.append(token_id)
    for index, (token, token_type) in enumerate(zip(metadata.tokens, metadata.token_types, strict=False)):
        if token_type == CONTROL and token in _END_OF_TURN_TEXTS and index not in end_ids:
            end_ids.append(index)
    config: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {}
    existing = config.get("eos_token_id")
    existing_ids = [] if existing is None else [existing] if isinstance(existing, int) else list(existing)
    merged = existing_ids + [token_id for token_id in end_ids if token_id not in existing_ids]
    if merged:
        config["eos_token_id"] = merged[0] if len(merged) == 1 else merged
    bos_id = metadata.token_id("tokenizer.ggml.bos_token_id")
    if bos_id is not None:
        config.setdefault("bos_token_id", bos_id)
    pad_id = metadata.token_id("tokenizer.ggml.padding_token_id")
    if pad_id is not None:
        config.setdefault("pad_token_id", pad_id)
    path.write_text(json.dumps(config, indent=2) + "\n")
