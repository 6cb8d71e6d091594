"""OpenAI-compatible request and response models (completions, chat completions, tokenize).

Requests ignore unknown fields (OpenAI clients send some Tandem does not use). Responses are built
from these models and serialized with `model_dump(exclude_none=True)` where OpenAI leaves fields out.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_serializer


class _Request(BaseModel):
    """Request bodies: unknown fields are ignored (OpenAI clients send some Tandem does not use);
    known ones are strict, as OpenAI's API is: no string-to-number or number-to-bool coercion."""

    model_config = ConfigDict(extra="ignore", strict=True)


class _Open(_Request):
    """A request object whose unknown fields are kept and handed to the chat template (agents send
    back e.g. `reasoning_content`; tool definitions carry fields some templates print)."""

    model_config = ConfigDict(extra="allow", strict=True)


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class _SamplingFields(_Request):
    """Sampling fields shared by /v1/completions and /v1/chat/completions.

    None means "not given": the checkpoint's generation_config.json default applies, then Tandem's.
    Their ranges are checked where they are used, by the engine (`SamplingParams`).
    """

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for legacy completions
    logprobs: int | None = None
    echo: bool = False
    add_special_tokens: bool = True
    response_format: ResponseFormat | None = None  # as vLLM: the whole completion is the JSON


class ContentPart(_Open):
    """One part of a message's content. Only text parts can be rendered (the chat template says so
    with a 400); other kinds are recognised here so that their error names the part."""

    type: str
    text: str | None = None


class FunctionCall(_Request):
    name: str
    arguments: str | dict[str, Any]  # OpenAI sends a JSON string; some clients send the object


class ToolCall(_Open):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Open):
    """One chat message. Extra fields (e.g. `reasoning_content` sent back by agents) are kept and
    handed to the chat template, which may use them."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Open):
    name: str = Field(pattern=r"^[A-Za-z0-9_.:-]{1,128}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Open):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Request):
    name: str
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list[Tool] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


def chat_template_inputs(req: ChatCompletionRequest | TokenizeRequest) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A chat request's messages and tools as the plain data a chat template reads (fields the
    client did not send are left out). With tool_choice "none" the tools are not rendered."""
    messages = [m.model_dump(exclude_none=True) for m in req.messages or ()]
    if not req.tools or getattr(req, "tool_choice", None) == "none":
        return messages, None
    return messages, [t.model_dump(exclude_none=True) for t in req.tools]


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


# The body each POST route parses (for /openapi.json).
REQUEST_BODIES: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
}


# ---------------------------------------------------------------------------------------------
# Responses


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] = Field(default_factory=list)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class ChatMessageOut(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # `ToolCallDelta.to_openai()` shapes


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @field_serializer("delta")
    def _delta_without_nones(self, delta: DeltaMessage) -> dict[str, Any]:
        return delta.model_dump(exclude_none=True)


class _StreamChunk(BaseModel):
    """Fields and SSE framing shared by the chat and completion stream chunks."""

    id: str
    object: str  # each subclass fixes it
    created: int = Field(default_factory=_now)
    model: str
    choices: list[Any]
    usage: UsageInfo | None = None

    def sse(self) -> str:
        """One server-sent event; `usage` appears only on the chunk that carries it."""
        return f"data: {self.model_dump_json(exclude={'usage'} if self.usage is None else None)}\n\n"


class ChatCompletionChunk(_StreamChunk):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class CompletionChunk(_StreamChunk):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tandem"
    root: str | None = None
    parent: str | None = None
    max_model_len: int
    permission: list[dict[str, Any]] = Field(default_factory=list)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str
