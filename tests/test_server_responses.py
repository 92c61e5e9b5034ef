"""OpenAI's Responses API (`POST /v1/responses`) on a real server, through the official openai client: text,
streamed events, function tools over two turns, JSON output, log probabilities, and the fields a stateless
server refuses."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from harness.server import ServerProcess
from titan.server.responses import ResponseShell
from titan.server.responses_protocol import ResponsesRequest

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def model(api_client: openai.OpenAI) -> str:
    return api_client.models.list().data[0].id


def test_text_response_matches_chat_completions(api_client: openai.OpenAI, model: str) -> None:
    response = api_client.responses.create(model=model, input="Name the capital of France.",
                                       instructions="Answer in one word.", max_output_tokens=8, temperature=0)
    chat = api_client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "Name the capital of France."}])
    assert response.status in ("completed", "incomplete") and response.output_text
    assert response.output_text == chat.choices[0].message.content  # the same prompt, greedy
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == chat.usage.completion_tokens
    assert response.id.startswith("resp_") and response.output[0].type == "message"
    cut = api_client.responses.create(model=model, input="Tell me a long story.", max_output_tokens=3)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"


def test_streamed_events_add_up_to_the_response(api_client: openai.OpenAI, model: str) -> None:
    events = list(api_client.responses.create(model=model, input="Count from one to five.", max_output_tokens=16,
                                          temperature=0, stream=True))
    kinds = [event.type for event in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] in ("response.completed",
                                                                                      "response.incomplete")
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert events[0].response.model == model and events[0].response.status == "in_progress"
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    done = [event.text for event in events if event.type == "response.output_text.done"]
    final = events[-1].response
    assert deltas and done == [deltas] and final.output_text == deltas and final.usage.output_tokens > 0
    whole = api_client.responses.create(model=model, input="Count from one to five.", max_output_tokens=16,
                                    temperature=0)
    assert whole.output_text == deltas


def test_function_tool_over_two_turns(api_client: openai.OpenAI, model: str) -> None:
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = api_client.responses.create(model=model, input=ask, tools=[WEATHER], tool_choice="required",
                                    parallel_tool_calls=False, temperature=0, max_output_tokens=64)
    calls = [item for item in first.output if item.type == "function_call"]
    assert calls and calls[0].name == "get_weather" and "city" in json.loads(calls[0].arguments)
    # Streamed, the same call arrives as an item with argument deltas.
    events = list(api_client.responses.create(model=model, input=ask, tools=[WEATHER], temperature=0,
                                          tool_choice={"type": "function", "name": "get_weather"},
                                          max_output_tokens=64, stream=True))
    streamed = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert streamed == calls[0].arguments
    assert [e.item.name for e in events if e.type == "response.output_item.done"] == ["get_weather"]
    # The next turn sends the call and its output back as input items.
    second = api_client.responses.create(model=model, tools=[WEATHER], temperature=0, max_output_tokens=24, input=[
        *ask, {"type": "function_call", "call_id": calls[0].call_id, "name": "get_weather",
               "arguments": calls[0].arguments},
        {"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 degrees"}])
    assert second.status in ("completed", "incomplete") and second.output


def test_json_schema_text_format(api_client: openai.OpenAI, model: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    response = api_client.responses.create(model=model, input="Which city is the capital of France? JSON.",
                                       max_output_tokens=40, temperature=0, text={"format": {
                                           "type": "json_schema", "name": "city", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(response.output_text), schema)


def test_log_probabilities_whole_and_streamed(api_client: openai.OpenAI, model: str) -> None:
    """include message.output_text.logprobs with top_logprobs: one entry per output token with its top
    alternatives, as chat's; streamed, each text delta carries its own tokens' and the done event all."""
    ask = {"model": model, "input": "Name three colours.", "max_output_tokens": 12, "temperature": 0,
           "include": ["message.output_text.logprobs"], "top_logprobs": 2}
    response = api_client.responses.create(**ask)
    part = response.output[0].content[0]
    assert len(part.logprobs) == response.usage.output_tokens and response.top_logprobs == 2
    assert "".join(entry.token for entry in part.logprobs) == part.text
    assert all(entry.logprob <= 0 and len(entry.top_logprobs) == 2 and entry.bytes for entry in part.logprobs)
    chat = api_client.chat.completions.create(model=model, max_tokens=12, temperature=0, logprobs=True,
                                              top_logprobs=2, messages=[{"role": "user", "content": ask["input"]}])
    assert [entry.token for entry in part.logprobs] == [entry.token for entry in chat.choices[0].logprobs.content]
    events = list(api_client.responses.create(**ask, stream=True))
    deltas = [event for event in events if event.type == "response.output_text.delta"]
    (done,) = [event for event in events if event.type == "response.output_text.done"]
    streamed = [entry.token for event in deltas for entry in event.logprobs]
    assert streamed == [entry.token for entry in done.logprobs] == [entry.token for entry in part.logprobs]
    # Without either field, no log probabilities are computed: the list is there and empty.
    plain = api_client.responses.create(model=model, input="Hi", max_output_tokens=4)
    assert plain.output[0].content[0].logprobs == [] and plain.top_logprobs is None


@pytest.mark.parametrize(("field", "value", "param"), [
    ("previous_response_id", "resp_123", "previous_response_id"),
    ("store", True, "store"),
    ("background", True, "background"),
    ("tools", [{"type": "web_search"}], "tools.0"),
    ("max_output_tokens", 10**6, "max_output_tokens"),
    ("input", [], "input"),
    ("top_logprobs", 21, "top_logprobs"),
    ("include", ["message.output_text.logprobs", "reasoning.encrypted_content"], "include"),
    ("conversation", "conv_1", "conversation"),
    ("text", {"format": {"type": "json_schema", "name": "x"}}, "text.format.json_schema"),
    ("tool_choice", {"type": "function", "name": 5}, "tool_choice"),
])
def test_what_a_stateless_server_cannot_do_is_a_400(api_server: ServerProcess, field: str, value: object,
                                                    param: str) -> None:
    reply = httpx.post(api_server.url + "/v1/responses", json={"input": "Hi", field: value}, timeout=120)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param


def test_cut_answers_are_incomplete_responses() -> None:
    shell = ResponseShell(ResponsesRequest(input="x"), "m")
    assert shell.response("completed", [], None, "stop")["status"] == "completed"
    for finish, reason in (("length", "max_output_tokens"), ("content_filter", "content_filter")):
        cut = shell.response("completed", [], None, finish)
        assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": reason}
