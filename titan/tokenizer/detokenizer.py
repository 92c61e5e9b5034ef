"""Streaming detokenization: one generated token in, the text it completes out.

Decoding token by token goes wrong two ways: a character split over several byte tokens decodes to
U+FFFD halves, and decoders that strip or merge spaces treat a lone token unlike the same token in
context. So we decode a short window twice — the already-emitted tokens before `read_offset` (from
`prefix_offset`) with and without the new tokens — and emit the difference once it ends in a whole
character. The window restarts after every emission, keeping the work per token constant.
"""

from __future__ import annotations

from collections.abc import Sequence

from titan.tokenizer.tokenizer import Tokenizer

# Prompt tokens decoded as context before the first output token, so its leading space is right.
PROMPT_CONTEXT_TOKENS = 5
# A valid character needs at most 4 byte tokens; more pending tokens that still end in U+FFFD are
# invalid bytes from the model, released as U+FFFD rather than growing the window without end.
MAX_PENDING_TOKENS = 8
MAX_CHARACTER_BYTES = 4  # UTF-8
REPLACEMENT_CHARACTER = "\ufffd"


class IncrementalDetokenizer:
    """Turns a stream of generated ids into text deltas, applying `stop` strings.

    `append` returns only text that is final: whole characters, never part of a stop string, and nothing
    once a stop string matched (`stop_string` is then set and `text` ends just before it, or just after it
    with `include_stop`). Text that may be the start of a stop string is held until the next tokens decide;
    `flush` releases it at the end.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop: bool = False,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stops = tuple(s for s in stop if s)
        self._include_stop = include_stop
        self._longest_stop = max((len(s) for s in self._stops), default=0)
        context = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        # A prompt ending inside a character would make the context text change under the first output
        # token; start the context at whole characters instead.
        while context and self._decode(context).endswith(REPLACEMENT_CHARACTER):
            context.pop()
        self._token_ids = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._prefix_text = self._decode(context)
        self._text = ""  # decoded output, cut before a stop string once one matched
        self._emitted = 0  # characters of `_text` already returned
        self.stop_string: str | None = None
        self.num_output_tokens = 0

    @property
    def text(self) -> str:
        """The output text released so far: always the concatenation of every returned delta, so it
        never holds a stop string or the start of one (after `flush`, the whole output)."""
        return self._text[:self._emitted]

    def append(self, token_id: int) -> str:
        """Add one generated token; return the newly final text (possibly empty)."""
        self.num_output_tokens += 1
        if self.stop_string is not None:
            return ""
        self._token_ids.append(token_id)
        delta = self._decode_pending(final=False)
        return self._add_text(delta, final=False)

    def flush(self) -> str:
        """At the end of generation: release held-back text that did not become a stop string (and any
        trailing incomplete character, as U+FFFD, exactly as a full decode shows it)."""
        if self.stop_string is not None:
            return ""
        delta = self._decode_pending(final=True)
        return self._add_text(delta, final=True)

    def _decode(self, token_ids: Sequence[int]) -> str:
        return self._tokenizer.backend.decode(list(token_ids), skip_special_tokens=self._skip_special_tokens)

    def _decode_pending(self, final: bool) -> str:
        if len(self._token_ids) == self._read_offset:
            return ""
        full_text = self._decode(self._token_ids[self._prefix_offset:])
        pending = len(self._token_ids) - self._read_offset
        split = full_text.endswith(REPLACEMENT_CHARACTER)
        # No longer text: the new tokens show nothing yet (a skipped special token, a partial character).
        if not final and (len(full_text) <= len(self._prefix_text) or (split and pending < MAX_PENDING_TOKENS)):
            return ""
        end = len(self._token_ids)
        if split and not final:
            end, full_text = self._release_point(full_text)
        delta = full_text[len(self._prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = end
        self._prefix_text = self._decode(self._token_ids[self._prefix_offset:end])
        # Drop ids before the window so memory stays bounded for long generations.
        if self._prefix_offset > 0:
            del self._token_ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta

    def _release_point(self, full_text: str) -> tuple[int, str]:
        """Where to cut a window of invalid bytes from the model, released as U+FFFD, and the text before it.
        The last tokens may still begin a valid character (at most 3 of its bytes can be here yet), so the cut
        leaves them pending; and it falls between characters, where the two sides decode to the whole (cut
        inside a character, or before a character's last byte arrived, its U+FFFD stayed in the text)."""
        ids = self._token_ids
        latest = len(ids) - (MAX_CHARACTER_BYTES - 1)
        for end in range(latest, self._read_offset, -1):
            head = self._decode(ids[self._prefix_offset:end])
            if head + self._decode(ids[end:]) == full_text:
                return end, head
        return latest, self._decode(ids[self._prefix_offset:latest])  # a decoder that is not split-invariant

    def _add_text(self, delta: str, final: bool) -> str:
        if not delta and not final:
            return ""
        previous_length = len(self._text)
        self._text += delta
        hold = 0
        if self._stops:
            # Any new match must overlap the delta, so search only from where that is possible.
            search_from = max(0, previous_length - self._longest_stop + 1)
            match = self._find_stop(search_from)
            if match is not None:
                position, stop = match
                self.stop_string = stop
                self._text = self._text[:position + (len(stop) if self._include_stop else 0)]
                hold = 0
            elif not final:
                hold = self._stop_prefix_length()
        end = len(self._text) - hold
        released = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return released

    def _find_stop(self, search_from: int) -> tuple[int, str] | None:
        best: tuple[int, str] | None = None
        for stop in self._stops:
            position = self._text.find(stop, search_from)
            if position >= 0 and (best is None or position < best[0]):
                best = (position, stop)
        return best

    def _stop_prefix_length(self) -> int:
        """Length of the longest unreleased tail of the text that some stop string starts with."""
        limit = min(self._longest_stop - 1, len(self._text) - self._emitted)
        for length in range(limit, 0, -1):
            tail = self._text[-length:]
            if any(stop.startswith(tail) for stop in self._stops):
                return length
        return 0
