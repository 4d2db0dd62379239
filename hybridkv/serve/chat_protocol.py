"""Chat request bodies: messages (text parts, tool calls and results) and /v1/chat/completions' own fields."""

from __future__ import annotations

from pydantic import BaseModel, Field, field_validator, model_validator

from hybridkv.request.sampling_params import MAX_LOGPROBS
from hybridkv.serve.protocol import STRICT, APIError, _Sampling
from hybridkv.serve.tools import Tool, ToolCallIn, ToolChoice


class TextPart(BaseModel):
    model_config = STRICT
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    model_config = STRICT
    role: str
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = Field(default=None, max_length=128)  # an assistant's calls, sent back
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None

    @model_validator(mode="after")
    def _content_or_calls(self) -> ChatMessage:
        if self.content is None and not self.tool_calls:
            raise ValueError("a message needs content (null only for an assistant message with tool_calls)")
        return self

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: str | list[TextPart] | None) -> str | None:
        """OpenAI content parts: text parts are joined; other kinds (images, audio) are not supported."""
        if content is None or isinstance(content, str):
            return content
        kinds = {p.type for p in content} - {"text"}
        if kinds:
            raise ValueError(f"only text content parts are supported, got {', '.join(sorted(kinds))}")
        return "".join(p.text for p in content)


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)  # the newer name of max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[Tool] | None = Field(default=None, max_length=128)
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True

    def _max_tokens(self) -> int | None:
        if self.max_tokens == 0:
            raise APIError(400, "max_tokens must be at least 1", param="max_tokens")
        return self.max_completion_tokens or self.max_tokens

    def _logprobs(self) -> int | None:
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None
