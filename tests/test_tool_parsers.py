"""Tool-call parsing and prompt rendering, no model: the formats `tool_choice: auto` reads back."""

from __future__ import annotations

import json

from titan.server.tools import MAX_PARALLEL_TOOL_CALLS, constraint_for, parse_tool_calls, render_conversation

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
    assert parse_tool_calls('[{"name": "f", "argu', "required", "hermes") == ('[{"name": "f", "argu', [])
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
