"""OpenAI API bodies served by the gateway (`gateway`): requests, responses, stream chunks, errors.

Fields and semantics follow the OpenAI API reference (Completions, Chat Completions, Models), as
the official `openai` client sends and parses them. `top_k` is an extension, as in vLLM.

Requests validate everything the gateway relies on, so a bad field is a 400 naming it (the
gateway turns pydantic's errors into OpenAI's error shape). Features we do not implement and that
would silently change the answer (n > 1, logprobs, echo, tools, JSON mode, penalties) are rejected,
not ignored; purely informational ones (`user`, `name`, `tool_choice`) are accepted and ignored.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, SerializationInfo, field_validator, model_serializer
from pydantic_core import PydanticCustomError

FinishReason = Literal["stop", "length"]


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", "{what} is not supported", {"what": what})


def _invalid(message: str) -> PydanticCustomError:
    return PydanticCustomError("invalid_value", message)


# ------------------------------------------------------------------------------------ requests


class StreamOptions(BaseModel):
    include_usage: bool = False


class _GenerationFields(BaseModel):
    """Fields common to both endpoints. None = the OpenAI default (applied by the gateway)."""

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, description="Extension (vLLM): keep the k likeliest; 0, -1 = off")
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: list[str] = Field(default_factory=list, description="Stop sequences (a string or a list)")
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_list(cls, v: Any) -> list[str]:
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise _invalid("expected a string or a list of strings")
        if any(s == "" for s in v):
            raise _invalid("stop sequences must not be empty")
        return v

    @field_validator("n")
    @classmethod
    def _only_one(cls, v: int) -> int:
        if v != 1:
            raise _unsupported(f"n={v} (only n=1)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, v: float | None) -> float | None:
        if v:
            raise _unsupported("a non-zero penalty")
        return v


class CompletionRequest(_GenerationFields):
    """POST /v1/completions. `prompt`: text, a list of one text, or token ids (a list of ints, or
    a list of one such list). Text is tokenized as is (no chat template)."""

    prompt: str | list[int]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _one_prompt(cls, v: Any) -> Any:
        if isinstance(v, list) and len(v) == 1 and isinstance(v[0], str | list):
            v = v[0]  # a batch of one
        if isinstance(v, str):
            return v
        if isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v):
            return v
        if isinstance(v, list) and len(v) > 1 and all(isinstance(p, str | list) for p in v):
            raise _unsupported("more than one prompt per request")
        raise _invalid("expected a string, a list of one string, or a non-empty list of token ids")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: int | None) -> int | None:
        if v is not None:
            raise _unsupported("logprobs")
        return v

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, v: bool) -> bool:
        if v:
            raise _unsupported("echo")
        return v

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, v: int | None) -> int | None:
        if v is not None and v != 1:
            raise _unsupported(f"best_of={v} (only 1)")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> str | None:
        if v:
            raise _unsupported("suffix")
        return v


class ChatMessage(BaseModel):
    """One message. `content`: a string or a list of text parts (joined with newlines, as vLLM
    does); null (an assistant turn that only called tools) is an empty string. `developer` is
    OpenAI's newer name for `system`."""

    role: Literal["system", "developer", "user", "assistant"]
    content: str = ""
    name: str | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text(cls, v: Any) -> str:
        if v is None:
            return ""
        if isinstance(v, str):
            return v
        if isinstance(v, list):
            texts = []
            for part in v:
                is_dict = isinstance(part, dict)
                if not is_dict or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type") if is_dict else type(part).__name__
                    raise _invalid(f"only text content parts are supported, got {kind!r}")
                texts.append(part["text"])
            return "\n".join(texts)
        raise _invalid("expected a string or a list of text parts")


class ChatCompletionRequest(_GenerationFields):
    """POST /v1/chat/completions. `max_completion_tokens` (OpenAI's newer name) wins over
    `max_tokens`."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, v: bool | None) -> bool | None:
        if v:
            raise _unsupported("logprobs")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, v: int | None) -> int | None:
        if v:
            raise _unsupported("top_logprobs")
        return v

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, v: list[Any] | None) -> list[Any] | None:
        if v:
            raise _unsupported("tools")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type", "text") != "text":
            raise _unsupported(f"response_format {v.get('type')!r}")
        return v

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ----------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    """A /v1/completions response, and (with `finish_reason` None until the last) a stream chunk."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """A streamed piece of the assistant message; unset fields are left out, as OpenAI does
    (the first delta carries the role, later ones only content, the last is empty)."""

    role: Literal["assistant"] | None = None
    content: str | None = None

    @model_serializer(mode="wrap")
    def _drop_none(self, handler: Any, info: SerializationInfo) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    """One `data:` event of a streamed chat completion. The usage chunk (stream_options.
    include_usage) has empty `choices`."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "cosine"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorDetail(BaseModel):
    message: str
    type: str
    code: str | None = None
    param: str | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error body: `{"error": {"message", "type", "code", "param"}}`."""

    error: ErrorDetail
