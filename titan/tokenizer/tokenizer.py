"""Text <-> token ids for a model folder in HF layout, backed by the `tokenizers` library only."""

from __future__ import annotations

import functools
import json
import pathlib
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tokenizers import Tokenizer as BackendTokenizer

from titan.tokenizer.chat_template import render_chat_template
from titan.tokenizer.gguf_convert import byte_level_alphabet


class Tokenizer:
    """Encodes prompts, decodes outputs and renders the model's chat template.

    BOS handling: `tokenizer.json`'s post-processor adds BOS when the model wants it (HF layout); when it
    does not but `tokenizer_config.json` says `add_bos_token`, we add it. A prompt that already starts
    with the BOS text (chat templates often write it) never gets a second one.
    """

    def __init__(
        self,
        backend: BackendTokenizer,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        add_bos_token: bool = False,
        add_eos_token: bool = False,
        chat_template: str | None = None,
        extra_eos_token_ids: Iterable[int] = (),
        bos_token_id: int | None = None,
    ) -> None:
        self.backend = backend
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.add_bos_token = add_bos_token
        self.add_eos_token = add_eos_token
        self.chat_template = chat_template
        self.bos_token_id: int | None = self._id_of(bos_token) if bos_token is not None else bos_token_id
        self.eos_token_id: int | None = self._id_of(eos_token)
        self.pad_token_id: int | None = self._id_of(pad_token)
        eos_ids = {token_id for token_id in extra_eos_token_ids if token_id is not None}
        if self.eos_token_id is not None:
            eos_ids.add(self.eos_token_id)
        self.eos_token_ids: frozenset[int] = frozenset(eos_ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        probe = backend.encode("", add_special_tokens=True).ids
        self._post_processor_adds_bos = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self.all_special_ids: frozenset[int] = frozenset(
            token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
        )

    @classmethod
    def from_folder(cls, path: str | pathlib.Path) -> Tokenizer:
        """Load `tokenizer.json` plus `tokenizer_config.json`, the chat template (from the config,
        `chat_template.jinja` or `chat_template.json`) and extra EOS ids from `generation_config.json`
        and `config.json`."""
        folder = pathlib.Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {folder}")
        backend = BackendTokenizer.from_file(str(tokenizer_file))
        config = _read_json(folder / "tokenizer_config.json")
        generation_config = _read_json(folder / "generation_config.json")
        model_config = _read_json(folder / "config.json")

        extra_eos_ids = [*_as_ids(generation_config.get("eos_token_id")),
                         *_as_ids(model_config.get("eos_token_id"))]
        bos_token_id = None
        if "bos_token" not in config:
            # An old folder without a tokenizer config: fall back to the model's numbers.
            bos_token_id = generation_config.get("bos_token_id", model_config.get("bos_token_id"))
        return cls(
            backend,
            bos_token=_token_content(config.get("bos_token")),
            eos_token=_token_content(config.get("eos_token")),
            unk_token=_token_content(config.get("unk_token")),
            pad_token=_token_content(config.get("pad_token")),
            add_bos_token=bool(config.get("add_bos_token", False)),
            add_eos_token=bool(config.get("add_eos_token", False)),
            chat_template=_read_chat_template(folder, config),
            extra_eos_token_ids=extra_eos_ids,
            bos_token_id=bos_token_id,
        )

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (plain encode does not), so a long prompt tokenized on the
        # HTTP side never stalls the engine thread.
        ids: list[int] = self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if not add_special_tokens:
            return ids
        bos = self.bos_token_id
        if bos is not None and (self.add_bos_token or self._post_processor_adds_bos):
            text_has_bos = bool(self.bos_token) and text.startswith(self.bos_token)
            if self._post_processor_adds_bos:
                if text_has_bos and len(ids) >= 2 and ids[1] == bos:
                    del ids[0]
            elif not text_has_bos:
                ids.insert(0, bos)
        eos = self.eos_token_id
        if self.add_eos_token and eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        return ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes a token stands for (OpenAI's logprobs `bytes`): a token holding part of a character is
        its own bytes, where decoding it alone gives the replacement character's."""
        piece = self.id_to_token(token_id)
        if piece is not None and type(self.backend.decoder).__name__ == "ByteLevel":
            byte_of = _byte_of_character()
            if all(character in byte_of for character in piece):
                return bytes(byte_of[character] for character in piece)
        if piece is not None and len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return bytes([int(piece[3:5], 16)])  # SentencePiece's byte fallback
        return self.decode([token_id], skip_special_tokens=False).encode("utf-8")

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary entry (e.g. `Ġworld` in a byte-level vocabulary), or None if out of range."""
        return self.backend.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)

    def encode_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """Token ids of a conversation ready for the assistant's reply: the chat template rendered with
        its generation prompt, encoded with special tokens (a BOS the template wrote is not doubled)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt=True))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        *,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """Render the conversation to a prompt string (to encode with `add_special_tokens=True`; a BOS
        the template writes is not doubled). `chat_template` overrides the model's own.

        Raises ValueError when neither exists: guessing a format silently gives poor answers, so the
        caller decides (`chat_template.FALLBACK_CHAT_TEMPLATE` is available to pass explicitly)."""
        template = chat_template or self.chat_template
        if not template:
            raise ValueError(
                "this model has no chat template; use the completions API or supply a chat template"
            )
        special_tokens = {"bos_token": self.bos_token, "eos_token": self.eos_token,
                          "unk_token": self.unk_token, "pad_token": self.pad_token}
        return render_chat_template(template, messages, add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message,
                                    special_tokens=special_tokens, tools=tools, **template_kwargs)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)


@functools.cache
def _byte_of_character() -> dict[str, int]:
    """A byte-level vocabulary's characters back to the bytes they print."""
    return {character: byte for byte, character in byte_level_alphabet().items()}


def _read_json(path: pathlib.Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    with path.open(encoding="utf-8") as file:
        value = json.load(file)
    return value if isinstance(value, dict) else {}


def _token_content(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens either as text or as an AddedToken object.
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _as_ids(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [item for item in value if isinstance(item, int)]
    return []


def _read_chat_template(folder: pathlib.Path, config: Mapping[str, Any]) -> str | None:
    # transformers >= 4.43 saves the template beside the config; that file wins, as in transformers.
    jinja_file = folder / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if template is None:
        template = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(template, list):
        # Several named templates: the one named "default" is the chat template.
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
