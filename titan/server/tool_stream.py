"""Tool calls streamed as the model writes them, in OpenAI's chunk format.

A call's first delta carries its index, id, type and name (with whatever arguments are already known);
the next ones carry fragments of `function.arguments`, the raw JSON text of the arguments object as
the model writes it, so the fragments concatenate to a parseable string. A call is announced only once
its name is complete; text outside calls streams as `content`, except what could still be the start
of a `<tool_call>` tag (held back like a stop string).

The text is read one character at a time with a small JSON lexer: depth, strings and escapes are
enough to find the top-level keys of a call object (`name`, `arguments` / `parameters`) and where
the arguments value begins and ends.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
ARGUMENT_KEYS = ("arguments", "parameters")  # hermes and llama3_json


class _Call:
    """One call object, `{"name": ..., "arguments": {...}}`, fed character by character."""

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = self.escape = False
        self.expect = "key"  # key | colon | value | None (inside a value)
        self.key: str | None = None
        self.reading: str | None = None  # which top-level string is being read: key | name
        self.raw: list[str] = []  # that string's raw characters
        self.name: str | None = None
        self.arguments = "none"  # none | stream (an object or array, sent as it comes) | other | done
        self.pending: list[str] = []  # argument text not sent yet
        self.done = False
        self.index: int | None = None  # set when announced
        self.id = f"call_{uuid.uuid4().hex[:24]}"

    def push(self, c: str) -> None:
        at_top = self.depth == 1 and not self.in_string
        if self.expect == "value" and at_top and not c.isspace():
            self.expect = None
            if self.key in ARGUMENT_KEYS:
                self.arguments = "stream" if c in "{[" else "other"
        if self.arguments == "other" and at_top and c in ",}":
            self._end_other()
        elif self.arguments in ("stream", "other"):
            self.pending.append(c)
        self._lex(c)

    def _lex(self, c: str) -> None:
        if self.in_string:
            if self.escape:
                self.escape = False
            elif c == "\\":
                self.escape = True
            elif c == '"':
                self.in_string = False
                self._string_done()
                return
            if self.reading is not None:
                self.raw.append(c)
            return
        if c == '"':
            self.in_string = True
            if self.depth == 1 and self.arguments not in ("stream", "other"):
                self.reading = "key" if self.expect == "key" else "name" if self.key == "name" else None
                self.raw = []
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            self.depth -= 1
            if self.depth == 1 and self.arguments == "stream":
                self.arguments = "done"
            if self.depth == 0:
                self.done = True
        elif self.depth == 1 and c == ":":
            self.expect = "value"
        elif self.depth == 1 and c == ",":
            self.expect = "key"

    def _string_done(self) -> None:
        reading, self.reading = self.reading, None
        if reading is None:
            return
        try:
            text = json.loads('"' + "".join(self.raw) + '"')
        except json.JSONDecodeError:
            text = "".join(self.raw)
        if reading == "key":
            self.key, self.expect = text, "colon"
        else:
            self.name = text

    def _end_other(self) -> None:
        """Arguments that are not an object (a JSON string holding one, say) are sent whole, decoded."""
        raw = "".join(self.pending).strip()
        try:
            value = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        self.pending = [value if isinstance(value, str) else json.dumps(value)]
        self.arguments = "done"

    def delta(self, next_index: int) -> dict[str, Any] | None:
        """What to send for this call now (None: nothing new, or its name is not complete yet)."""
        if self.name is None:
            return None
        text = ""
        if self.arguments in ("stream", "done"):
            text, self.pending = "".join(self.pending), []
        if self.done and self.arguments == "none":
            text, self.arguments = "{}", "done"  # a call without arguments
        if self.index is None:
            self.index = next_index
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": text}}
        return {"index": self.index, "function": {"arguments": text}} if text else None


class ToolCallStream:
    """One choice's text → (content delta, tool-call deltas), step by step.

    `required` / a named function: the text is JSON (an array of calls, or one call), no content.
    `auto` with hermes: content with `<tool_call>{...}</tool_call>` blocks. `auto` with llama3_json: calls
    (`{...}; {...}`, maybe after `<|python_tag|>`) if the first visible character opens one, else content.
    """

    def __init__(self, tool_choice: str | dict[str, Any], parser: str) -> None:
        if tool_choice == "required" or isinstance(tool_choice, dict):
            self.state = "json"
        else:
            self.state = "undecided" if parser == "llama3_json" else "content"
        self.hold = ""  # content that may still turn into a tag, or text inside a tag's tail
        self.call: _Call | None = None
        self.num_announced = 0
        self.num_complete = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        content: list[str] = []
        deltas: list[dict[str, Any]] = []
        for c in text:
            self._push(c, content, deltas)
        self._collect(deltas)
        return "".join(content), deltas

    def close(self) -> tuple[str, list[dict[str, Any]]]:
        """At the end of the choice: held-back content (a tag that never completed) and the last deltas."""
        deltas: list[dict[str, Any]] = []
        self._collect(deltas)
        content = self.hold if self.state in ("content", "undecided") else ""
        self.hold = ""
        return content, deltas

    @property
    def called(self) -> bool:
        """Whether at least one complete call was sent (finish_reason `tool_calls`)."""
        return self.num_complete > 0

    def _push(self, c: str, content: list[str], deltas: list[dict[str, Any]]) -> None:
        if self.call is not None:
            self.call.push(c)
            if self.call.done:
                self._collect(deltas)
                self.call = None
                self.state = "tail" if self.state == "block" else self.state
            return
        if self.state == "json":
            if c == "{":
                self._start(c)
        elif self.state == "content":
            self.hold += c
            if self.hold.endswith(OPEN_TAG):
                content.append(self.hold[: -len(OPEN_TAG)])
                self.hold, self.state = "", "block"
            else:
                keep = _partial_tag(self.hold, OPEN_TAG)
                content.append(self.hold[: len(self.hold) - keep])
                self.hold = self.hold[len(self.hold) - keep:]
        elif self.state == "block":
            if c == "{":
                self._start(c)
            elif not c.isspace():
                self.state = "tail"  # not a call object: skipped, as the whole-text parser skips it
        elif self.state == "tail":
            self.hold += c
            if self.hold.endswith(CLOSE_TAG):
                self.hold, self.state = "", "content"
        elif self.state == "undecided":
            if c.isspace():
                self.hold += c
            elif c in "{<":
                self.hold, self.state = "", "json"
                self._push(c, content, deltas)
            else:
                content.append(self.hold + c)
                self.hold, self.state = "", "plain"
        else:  # plain: llama3_json output that is not a call
            content.append(c)

    def _start(self, c: str) -> None:
        self.call = _Call()
        self.call.push(c)

    def _collect(self, deltas: list[dict[str, Any]]) -> None:
        call = self.call
        if call is None:
            return
        delta = call.delta(self.num_announced)
        if delta is not None:
            deltas.append(delta)
            if "id" in delta:
                self.num_announced += 1
        if call.done and call.index is not None:
            self.num_complete += 1


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag`."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0
