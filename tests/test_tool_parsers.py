"""Tool-call parsing and prompt rendering, no model: the formats `tool_choice: auto` reads back."""

from __future__ import annotations

import json

from titan.server.tool_stream import ToolCallStream
from titan.server.tools import (
    MAX_PARALLEL_TOOL_CALLS,
    complete_call,
    constraint_for,
    parse_tool_calls,
    render_conversation,
)

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_hermes_blocks_become_calls_and_the_rest_stays_content() -> None:
    text = 'Let me check.\n<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>\n<tool_call>{"name": "g", ' \
           '"arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, "auto", "hermes")
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [("f", {"x": 1}),
                                                                                               ("g", {})]
    assert parse_tool_calls("no calls here", "auto", "hermes") == ("no calls here", [])
    assert parse_tool_calls("<tool_call>{broken</tool_call>", "auto", "hermes")[1] == []


def test_llama3_json_and_constrained_outputs() -> None:
    content, calls = parse_tool_calls('<|python_tag|>{"name": "f", "parameters": {"a": "b"}}', "auto", "llama3_json")
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": "b"}
    assert parse_tool_calls("plain answer", "auto", "llama3_json") == ("plain answer", [])
    _, required = parse_tool_calls('[{"name": "f", "arguments": {}}, {"name": "f", "arguments": {"k": 2}}]',
                                   "required", "hermes")
    assert len(required) == 2
    # Cut short by max_tokens: the call as far as written, as the stream sends it (not the raw JSON as content).
    content, cut = parse_tool_calls('[{"name": "f", "arguments": {"x": 2, "y', "required", "hermes")
    assert content is None and [(c["function"]["name"], c["function"]["arguments"]) for c in cut] == [
        ("f", '{"x": 2, "y')]
    assert not complete_call(cut[0]) and all(complete_call(call) for call in required)
    assert parse_tool_calls('[{"na', "required", "hermes") == (None, [])
    assert constraint_for([TOOL], "auto", True) is None
    schema = json.loads(constraint_for([TOOL], "required", False).spec)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    assert json.loads(constraint_for([TOOL], "required", True).spec)["maxItems"] == MAX_PARALLEL_TOOL_CALLS


def test_a_template_without_tools_gets_them_in_the_system_prompt() -> None:
    history = [{"role": "user", "content": "hi"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
               {"role": "tool", "content": "42", "tool_call_id": "1"}]
    rendered = render_conversation(history, [TOOL], native=False)
    assert rendered[0]["role"] == "system" and '"name": "f"' in rendered[0]["content"]
    assert rendered[2]["content"] == '<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>'
    assert rendered[3] == {"role": "user", "content": "<tool_response>\n42\n</tool_response>"}
    assert render_conversation(history, [TOOL], native=True) is history


# ---- streamed tool calls: any chunking gives the calls the whole-text parser finds -------------------
STREAM_CASES = [
    ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris \\"x\\"", '
     '"n": [1, {"a": "}"}]}}</tool_call>\n<tool_call>{"name":"g","arguments":{}}</tool_call>', "auto", "hermes"),
    ('[{"name":"f","arguments":{"x":1}},{"name":"g","arguments":{"y":"]}"}}]', "required", "hermes"),
    ('{"name":"f","arguments":{"x":[1,2]}}', {"type": "function", "function": {"name": "f"}}, "hermes"),
    ('<|python_tag|>{"name": "f", "parameters": {"x": 1}}; {"name": "g", "parameters": {"q": 2}}', "auto",
     "llama3_json"),
    ('{"arguments": {"late": true}, "name": "f"}', "required", "hermes"),  # name after arguments: sent once known
    # Read alike whole and streamed since stop 58 (each was a call streamed, plain content or {} whole):
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', "auto", "hermes"),  # the model's end before the tag
    ('<tool_call>{"name": "f", "parameters": {"x": 1}}</tool_call>', "auto", "hermes"),
    ('Sure. <tool_call>{"name": "f", "arguments": {"x": 1}} ok</tool_call>', "auto", "hermes"),
]


def replay(text: str, choice, parser: str, size: int) -> tuple[str, list[dict], bool, int]:
    """Feed `text` in chunks of `size`; (content, calls as OpenAI dicts, called, argument fragments)."""
    stream = ToolCallStream(choice, parser)
    content, calls, fragments = "", {}, 0
    pieces = [stream.feed(text[start:start + size]) for start in range(0, len(text), size)] + [stream.close()]
    for piece, deltas in pieces:
        content += piece
        for delta in deltas:
            if delta["index"] not in calls:
                assert delta["id"].startswith("call_") and delta["type"] == "function" and delta["function"]["name"]
                calls[delta["index"]] = {"name": delta["function"]["name"], "arguments": ""}
            else:
                assert "id" not in delta and "name" not in delta["function"]
            calls[delta["index"]]["arguments"] += delta["function"]["arguments"]
            fragments += bool(delta["function"]["arguments"])
    assert sorted(calls) == list(range(len(calls)))
    return content, [calls[index] for index in sorted(calls)], stream.called, fragments


def test_streamed_calls_match_the_whole_text_parser_at_every_chunk_size() -> None:
    for text, choice, parser in STREAM_CASES:
        whole_content, whole = parse_tool_calls(text, choice, parser)
        expected = [(call["function"]["name"], json.loads(call["function"]["arguments"])) for call in whole]
        for size in (1, 2, 3, 7, len(text)):
            content, calls, called, fragments = replay(text, choice, parser, size)
            assert [(call["name"], json.loads(call["arguments"])) for call in calls] == expected, (text, size)
            assert called and content.strip() == (whole_content or "")
            if size == 1 and "late" not in text:
                assert fragments > len(calls)  # arguments stream as they are written, not whole


def test_streamed_content_holds_back_only_a_possible_tag() -> None:
    stream = ToolCallStream("auto", "hermes")
    assert stream.feed("Hello <tool") == ("Hello ", [])  # "<tool" may still become "<tool_call>"
    assert stream.feed("box> and <b>") == ("<toolbox> and <b>", [])
    assert stream.close() == ("", []) and not stream.called
    plain = ToolCallStream("auto", "llama3_json")
    assert plain.feed("  Sure {not a call}") == ("  Sure {not a call}", [])
    cut = ToolCallStream("required", "hermes")  # max_tokens cut the call short: announced, never complete
    _, deltas = cut.feed('[{"name": "f", "arguments": {"x": ')
    assert deltas[0]["function"]["name"] == "f" and not cut.called
