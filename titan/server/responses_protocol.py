"""OpenAI's Responses API request (`POST /v1/responses`), and the chat completions request it stands for.

Titan serves the Responses API as a translation of chat completions: `input` (a string, or messages and the
function-call items of an earlier turn) with `instructions` becomes `messages`, function `tools` lose their
wrapper, `text.format` becomes `response_format`. The request then runs the chat path unchanged (tenants,
guardrails, caches, admission), and `responses.py` turns its answer into a Response. Nothing is stored, so
what needs a stored response (`previous_response_id`, `store: true`, `background`) is a 400, as is any tool
type other than `function`. Log probabilities (`include: ["message.output_text.logprobs"]`, `top_logprobs`)
are chat's `logprobs` / `top_logprobs`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from titan.server.chat_protocol import ChatCompletionRequest
from titan.server.errors import bad_request, validation_error
from titan.server.fields import check_extra_fields

# The one `include` item a stateless server without tools of its own can honour.
LOGPROBS_INCLUDE = "message.output_text.logprobs"


class InputPart(BaseModel):
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputItem(BaseModel):
    """A message (`type` "message" or absent), a function call of an earlier turn, or its output."""

    type: Literal["message", "function_call", "function_call_output"] = "message"
    role: Literal["system", "developer", "user", "assistant"] | None = None
    content: str | list[InputPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | None = None


class FunctionTool(BaseModel):
    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextOptions(BaseModel):
    format: TextFormat | None = None


class ResponsesRequest(BaseModel):
    # Unknown fields are refused or logged by check_extra_fields, never dropped.
    model_config = ConfigDict(allow_inf_nan=False, extra="allow")

    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    tools: list[FunctionTool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True
    text: TextOptions | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    def check(self) -> None:
        extra = self.model_extra or {}
        for name in ("conversation", "prompt", "max_tool_calls"):  # known here, not honoured
            if extra.get(name) is not None:
                raise bad_request(f"{name} is not supported by this server", param=name,
                                  code="unsupported_parameter")
        check_extra_fields(extra)
        others = [item for item in self.include or [] if item != LOGPROBS_INCLUDE]
        refused = [("previous_response_id", self.previous_response_id is not None),
                   ("store", bool(self.store)), ("background", bool(self.background)),
                   ("reasoning", bool(self.reasoning and self.reasoning.get("effort"))),
                   ("truncation", self.truncation == "auto"), ("include", bool(others))]
        for name, asked in refused:
            if asked:
                raise bad_request(f"{name} is not supported by this server (responses are not stored, and this "
                                  "model does not reason)", param=name, code="unsupported_parameter")
        for index, tool in enumerate(self.tools or []):
            if tool.type != "function" or not tool.name:
                raise bad_request("only function tools (with a name) are supported", param=f"tools.{index}",
                                  code="unsupported_parameter")

    @property
    def logprobs(self) -> bool:
        """Output text with its tokens' log probabilities: asked by `include` or by a `top_logprobs` count."""
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None

    def to_chat(self) -> ChatCompletionRequest:
        """The chat completions request this one stands for (streamed with usage, for response.completed)."""
        fields: dict[str, Any] = {
            "model": self.model, "messages": self.messages(), "max_completion_tokens": self.max_output_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "stream": self.stream,
            "parallel_tool_calls": self.parallel_tool_calls, "user": self.user,
        }
        if self.stream:
            fields["stream_options"] = {"include_usage": True}
        if self.logprobs:
            fields |= {"logprobs": True, "top_logprobs": self.top_logprobs or 0}
        if self.tools:
            fields["tools"] = [{"type": "function", "function": tool.model_dump(exclude={"type"}, exclude_none=True)}
                               for tool in self.tools]
        if self.tool_choice is not None:
            fields["tool_choice"] = self._chat_tool_choice()
        format_ = self.text.format if self.text is not None else None
        if format_ is not None and format_.type != "text":
            json_schema = {"name": format_.name, "schema": format_.json_schema, "strict": format_.strict}
            fields["response_format"] = {"type": format_.type} | (
                {"json_schema": json_schema} if format_.type == "json_schema" else {})
        try:
            return ChatCompletionRequest.model_validate(fields)
        except ValidationError as error:  # a value this API's schema let through but chat's does not
            raise validation_error(error.errors()) from error

    def messages(self) -> list[dict[str, Any]]:
        messages: list[dict[str, Any]] = []
        if self.instructions:
            messages.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for index, item in enumerate(self.input):
            if item.type == "function_call":
                if not item.call_id or not item.name:
                    raise bad_request("a function_call item needs call_id and name", param=f"input.{index}")
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments or "{}"}}
                if messages and messages[-1]["role"] == "assistant" and messages[-1].get("tool_calls"):
                    messages[-1]["tool_calls"].append(call)  # parallel calls of one turn: one assistant message
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif item.type == "function_call_output":
                if not item.call_id:
                    raise bad_request("a function_call_output item needs call_id", param=f"input.{index}")
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output or ""})
            else:
                if item.role is None:
                    raise bad_request("a message item needs a role", param=f"input.{index}.role")
                content = item.content if isinstance(item.content, str) or item.content is None else \
                    "".join(part.text for part in item.content)
                messages.append({"role": item.role, "content": content})
        if not messages:
            raise bad_request("input must not be empty", param="input")
        return messages

    def _chat_tool_choice(self) -> str | dict[str, Any]:
        choice = self.tool_choice
        if isinstance(choice, str):
            if choice not in ("none", "auto", "required"):
                raise bad_request(f"tool_choice must be none, auto, required or a function, not {choice!r}",
                                  param="tool_choice")
            return choice
        if choice is None or choice.get("type") != "function" or not choice.get("name"):
            raise bad_request("tool_choice must name a function: {\"type\": \"function\", \"name\": ...}",
                              param="tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}


# Chat request fields as this API names them, for the errors the chat path raises.
RESPONSES_PARAM = {"messages": "input", "max_completion_tokens": "max_output_tokens",
                   "max_tokens": "max_output_tokens", "response_format": "text.format"}


def responses_param(param: str | None) -> str | None:
    """A chat field's path (`response_format.json_schema`) as this API names it (`text.format.json_schema`)."""
    if param is None:
        return None
    head, dot, rest = param.partition(".")
    return RESPONSES_PARAM[head] + dot + rest if head in RESPONSES_PARAM else param
