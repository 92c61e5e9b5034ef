"""LangChain's `ChatOpenAI` against a real server: tools bound with `bind_tools` (whole and streamed) and
`with_structured_output`, by JSON schema and by function calling — with no field ignored on the way.
`strict=True` as with OpenAI: LangChain then closes the schemas (`additionalProperties: false`), so a small
model cannot pad the arguments with properties of its own invention."""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, Field

from harness.server import ServerProcess

langchain_openai = pytest.importorskip("langchain_openai")


class GetWeather(BaseModel):
    """Current weather in a city."""

    city: str = Field(max_length=20, description="the city")
    unit: Literal["celsius", "fahrenheit"]


class City(BaseModel):
    """A city and its country."""

    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


ASK = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def server() -> ServerProcess:
    with ServerProcess(["--max-num-seqs", "4"]) as server:
        yield server


@pytest.fixture(scope="module")
def chat(server: ServerProcess):
    return langchain_openai.ChatOpenAI(base_url=server.url + "/v1", api_key="unused",
                                       model="SmolLM2-135M-Instruct.Q4_1", temperature=0, max_tokens=80,
                                       timeout=300, max_retries=0)


def test_bind_tools_gives_parsed_tool_calls(chat) -> None:
    message = chat.bind_tools([GetWeather], tool_choice="required", strict=True).invoke(ASK)
    assert message.response_metadata["finish_reason"] == "tool_calls"
    (call,) = message.tool_calls[:1]
    assert call["name"] == "GetWeather" and call["id"].startswith("call_")
    GetWeather.model_validate(call["args"])  # the arguments were constrained by the schema
    named = chat.bind_tools([GetWeather, City], tool_choice="City", strict=True).invoke("Where is the Eiffel Tower?")
    assert [call["name"] for call in named.tool_calls] == ["City"]
    City.model_validate(named.tool_calls[0]["args"])


def test_streamed_tool_calls_assemble_in_langchain(chat) -> None:
    chunks = list(chat.bind_tools([GetWeather], tool_choice="GetWeather", strict=True).stream(ASK))
    assert sum(1 for chunk in chunks if chunk.tool_call_chunks) > 2  # the call arrived in pieces
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert [call["name"] for call in whole.tool_calls] == ["GetWeather"]
    GetWeather.model_validate(whole.tool_calls[0]["args"])


def test_with_structured_output_by_schema_and_by_function_calling(chat) -> None:
    for method in ("json_schema", "function_calling"):
        city = chat.with_structured_output(City, method=method, strict=True).invoke("Name a large city in Japan.")
        assert isinstance(city, City), method


def test_nothing_langchain_sent_was_ignored(server: ServerProcess, chat) -> None:
    chat.invoke("Say hi.")
    assert "ignoring unknown request field" not in server.log()
