"""vLLM's `return_token_ids`: the prompt's and each choice's token ids beside the text.

Clients that train on or re-score what was generated (RL loops, agents replaying a turn) need the exact ids:
re-tokenizing the text need not give them back. Chat puts the prompt's ids on the response (streamed: its
first chunk) and each choice's ids on the choice; completions put both on each choice (streamed: the prompt's
on a choice's first entry). Streamed entries carry the ids of the tokens since the choice's last entry, so
ids released while the text was held back (a possible stop string) are not lost.
"""

from __future__ import annotations

from typing import Any

from titan.engine.outputs import RequestOutput
from titan.server.serving import Choice


class TokenIdFields:
    def __init__(self, chat: bool, shows_tokens: bool = True) -> None:
        self.chat = chat
        self.shows_tokens = shows_tokens  # false: the tokens are never shown (completions scoring a prompt)
        self.pending: dict[int, list[int]] = {}  # per choice, ids not yet sent
        self.started: set[int] = set()  # choices whose first entry went out
        self.response_sent = False

    def response(self, prompt_token_ids: list[int]) -> dict[str, Any]:
        """Top-level fields of a chat response (streamed: of its first chunk only)."""
        if not self.chat or self.response_sent:
            return {}
        self.response_sent = True
        return {"prompt_token_ids": prompt_token_ids}

    def whole(self, choice: Choice, output: RequestOutput) -> dict[str, Any]:
        fields: dict[str, Any] = {"token_ids": list(output.token_ids) if self.shows_tokens else []}
        if not self.chat:
            fields["prompt_token_ids"] = choice.prompt_token_ids
        return fields

    def feed(self, choice: Choice, output: RequestOutput) -> None:
        if self.shows_tokens:
            self.pending.setdefault(choice.index, []).extend(output.new_token_ids)

    def entry(self, choice: Choice) -> dict[str, Any]:
        """Fields of the choice's next streamed entry: the ids since its last one."""
        fields: dict[str, Any] = {"token_ids": self.pending.pop(choice.index, [])}
        if not self.chat and choice.index not in self.started:
            fields["prompt_token_ids"] = choice.prompt_token_ids
        self.started.add(choice.index)
        return fields
