"""Request schemas of /v1/chat/completions (messages, tools, the chat template's fields) and of the
tokenizer endpoints, which render messages through the same template fields."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from titan.server.errors import bad_request
from titan.server.protocol import SamplingRequest


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    name: str
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(allow_inf_nan=False)

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(BaseModel):
    type: Literal["function"]
    function: FunctionSpec


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


# Names the chat template gets from the server itself; chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_NAMES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                     "continue_final_message", "bos_token", "eos_token", "unk_token",
                                     "pad_token", "raise_exception", "strftime_now"})


class ChatTemplateFields(BaseModel):
    """How chat messages become the prompt (vLLM's fields, on /v1/chat/completions and /tokenize)."""

    add_generation_prompt: bool = True
    # The prompt ends inside the last message, so the model continues it (a reply begun for it).
    continue_final_message: bool = False
    # None: a BOS only where the tokenizer adds one and the template did not write it; false: none at all.
    add_special_tokens: bool | None = None
    documents: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template_fields(self) -> None:
        if self.continue_final_message and self.add_generation_prompt:
            raise bad_request("continue_final_message needs add_generation_prompt set to false: the prompt "
                              "cannot both continue the last message and open a new one",
                              param="continue_final_message")
        reserved = sorted(set(self.chat_template_kwargs or {}) & RESERVED_TEMPLATE_NAMES)
        if reserved:
            raise bad_request(f"chat_template_kwargs cannot set {', '.join(reserved)} (the server passes "
                              "those to the template itself)", param="chat_template_kwargs")

    def template_options(self) -> dict[str, Any]:
        """Keyword arguments of Tokenizer.apply_chat_template for these fields."""
        options = dict(self.chat_template_kwargs or {})
        options.update(add_generation_prompt=self.add_generation_prompt,
                       continue_final_message=self.continue_final_message)
        if self.documents is not None:
            options["documents"] = self.documents
        return options


class ChatCompletionRequest(SamplingRequest, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # None: whatever the context leaves
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    echo: bool = False  # vLLM's: a reply continuing an assistant message starts with that message's text

    def check(self) -> None:
        self.check_common()
        self.check_template_fields()
        if self.echo and self.tool_dicts() is not None:
            raise bad_request("echo cannot be combined with tools", param="echo")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")
        choice = self.tool_choice
        if choice not in (None, "none") and not self.tools:
            raise bad_request("tool_choice needs tools", param="tool_choice")
        names = {tool.function.name for tool in self.tools or []}
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice names {choice.function.name!r}, which is not among the tools",
                              param="tool_choice")

    @property
    def effective_tool_choice(self) -> str | dict[str, Any]:
        """none | auto | required | {"type": "function", "function": {"name": ...}}; auto when tools are given."""
        if self.tool_choice is None:
            return "auto" if self.tools else "none"
        return self.tool_choice if isinstance(self.tool_choice, str) else self.tool_choice.model_dump()

    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as plain JSON, or None when tools are off (absent, or tool_choice none)."""
        if not self.tools or self.effective_tool_choice == "none":
            return None
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def template_messages(self) -> list[dict[str, Any]]:
        return template_messages(self.messages)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template reads them. Templates know system/user/assistant; OpenAI's newer
    "developer" role is a system prompt."""
    rendered: list[dict[str, Any]] = []
    for m in messages:
        message: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
        if m.tool_calls:
            message["tool_calls"] = [call.model_dump(exclude_none=True) for call in m.tool_calls]
        if m.tool_call_id is not None:
            message["tool_call_id"] = m.tool_call_id
        rendered.append(message)
    return rendered


class TokenizeRequest(ChatTemplateFields):
    """vLLM's POST /tokenize: a prompt, or chat messages rendered through the chat template (with the chat
    endpoint's template fields). add_special_tokens None: true for a prompt, the chat default for messages."""

    model_config = ConfigDict(extra="allow")  # refused or logged by check_extra_fields, never dropped

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model: str | None = None
    tokens: list[int]
