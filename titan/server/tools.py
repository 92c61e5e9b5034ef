"""Tool calling: tools into the prompt, `tool_choice` into a grammar, the model's output into `tool_calls`.

A chat template that knows tools (it mentions `tools`) renders them itself; for one that does not, the
tools are described in the system prompt and calls are asked for in the Hermes format,
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, so the same parser reads them back.
`required` and a named function constrain the output with the tools' JSON schemas (structured outputs),
so the arguments always parse; `auto` leaves the model free and parses what it wrote with
`--tool-call-parser` (hermes, or llama3_json: `{"name": ..., "parameters": {...}}` objects).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from titan.engine.structured import StructuredOutputs
from titan.server.tool_stream import ToolCallStream

# `required` asks for a JSON array of calls; bounded, so a model repeating itself still ends the array.
MAX_PARALLEL_TOOL_CALLS = 8
FALLBACK_TOOL_PROMPT = (
    "You can call functions. To call one, answer with only "
    '<tool_call>{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}</tool_call>, '
    "one block per call. The functions, as JSON schemas:\n{tools}"
)


def template_knows_tools(template: str | None) -> bool:
    return bool(template) and "tools" in (template or "")


def render_conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                        native: bool) -> list[dict[str, Any]]:
    """Messages for a template without tool support: tools in the system prompt, earlier calls and their
    results as Hermes text. A native template gets the messages as they are (and `tools=` separately)."""
    if native:
        return messages
    rendered = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(f"<tool_call>{json.dumps(call_json(call))}</tool_call>" for call in message["tool_calls"])
            content = (message.get("content") or "") + ("\n" if message.get("content") else "") + calls
            rendered.append({"role": "assistant", "content": content})
        elif message["role"] == "tool":
            rendered.append({"role": "user", "content": f"<tool_response>\n{message['content']}\n</tool_response>"})
        else:
            rendered.append({"role": message["role"], "content": message.get("content") or ""})
    if tools:
        described = "\n".join(json.dumps(tool["function"]) for tool in tools)
        prompt = FALLBACK_TOOL_PROMPT.format(tools=described)
        if rendered and rendered[0]["role"] == "system":
            rendered[0] = {"role": "system", "content": rendered[0]["content"] + "\n\n" + prompt}
        else:
            rendered.insert(0, {"role": "system", "content": prompt})
    return rendered


def call_json(call: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI tool call as the Hermes JSON the model sees: arguments as an object, not a string."""
    arguments = call["function"].get("arguments") or "{}"
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        parsed = arguments
    return {"name": call["function"]["name"], "arguments": parsed}


def _call_schema(tool: dict[str, Any]) -> dict[str, Any]:
    function = tool["function"]
    parameters = function.get("parameters") or {"type": "object"}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def constraint_for(tools: list[dict[str, Any]], choice: str | dict[str, Any],
                   parallel: bool) -> StructuredOutputs | None:
    """required: a JSON array of calls to any of the tools; a named function: one call to it; else none."""
    if choice == "required":
        items = {"anyOf": [_call_schema(tool) for tool in tools]}
        schema: dict[str, Any] = {"type": "array", "items": items, "minItems": 1,
                                  "maxItems": MAX_PARALLEL_TOOL_CALLS if parallel else 1}
        return StructuredOutputs.of("json", schema, "tool_choice")
    if isinstance(choice, dict):
        name = choice["function"]["name"]
        tool = next(tool for tool in tools if tool["function"]["name"] == name)
        return StructuredOutputs.of("json", _call_schema(tool), "tool_choice")
    return None


def parse_tool_calls(text: str, choice: str | dict[str, Any], parser: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content left, OpenAI tool calls) from what the model wrote."""
    if choice == "required" or isinstance(choice, dict):
        try:
            parsed = json.loads(text)
        except json.JSONDecodeError:
            # Cut short by max_tokens: the call(s) as far as written, as streamed (each once its name is
            # complete); whole, the raw JSON used to come back as `content` while the stream sent a call.
            return None, _read_stream(text, choice, parser)[1]
        return None, [_openai_call(call["name"], call["arguments"]) for call in
                      (parsed if isinstance(parsed, list) else [parsed])]
    if parser == "llama3_json":
        return _parse_llama3(text)
    # Read as the stream reads it, so whole and streamed answers agree: a block the model left unclosed at its
    # end, `parameters` for `arguments`, text after the object inside a block (each was a call streamed and
    # plain content whole, or arguments {} whole).
    content, calls = _read_stream(text, choice, parser)
    if not calls:
        return text, []
    return content.strip() or None, calls


def _read_stream(text: str, choice: str | dict[str, Any], parser: str) -> tuple[str, list[dict[str, Any]]]:
    """(content, calls) a stream of `text` sends, its deltas put together."""
    stream = ToolCallStream(choice, parser)
    content: list[str] = []
    calls: dict[int, dict[str, Any]] = {}
    for piece, deltas in (stream.feed(text), stream.close()):
        content.append(piece)
        for delta in deltas:
            call = calls.setdefault(delta["index"], {"id": delta.get("id"), "type": "function",
                                                     "function": {"name": delta["function"].get("name"),
                                                                  "arguments": ""}})
            call["function"]["arguments"] += delta["function"].get("arguments", "")
    return "".join(content), [calls[index] for index in sorted(calls)]


def complete_call(call: dict[str, Any]) -> bool:
    """Whether a call's arguments are whole JSON (not cut short by max_tokens)."""
    try:
        json.loads(call["function"]["arguments"])
    except json.JSONDecodeError:
        return False
    return True


def _parse_llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    for piece in body.split(";"):
        try:
            parsed = json.loads(piece)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
            return text, []
        calls.append(_openai_call(parsed["name"], parsed.get("parameters", parsed.get("arguments", {}))))
    return None, calls


def _openai_call(name: str, arguments: Any) -> dict[str, Any]:
    text = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": {"name": name, "arguments": text}}
