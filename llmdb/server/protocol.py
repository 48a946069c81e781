"""The OpenAI-compatible request bodies `llmdb serve` accepts, and its error shape.

Fields follow OpenAI's API and vLLM's extensions to it (top_k, priority, ignore_eos,
prompt_logprobs); `request_class` is llmdb's: "interactive" requests are scheduled as
real-time work with latency targets, "bulk" ones as best-effort work.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from llmdb.engine.params import SamplingParams

MAX_STOP_STRINGS = 16

# Options of OpenAI's API (and vLLM's) that llmdb serve does not implement, and the values
# that mean "not used": any other value is a 400 naming the option, not silently ignored.
_UNUSED = {
    "logit_bias": ({}, None), "presence_penalty": (0, None), "frequency_penalty": (0, None),
    "repetition_penalty": (1, None), "min_p": (0, None), "min_tokens": (0, None),
    "best_of": (1, None), "suffix": ("", None), "echo": (False, None),
    "response_format": ({"type": "text"}, None), "tools": ([], None),
    "tool_choice": ("none", "auto", None), "functions": ([], None),
    "function_call": ("none", "auto", None), "guided_json": (None,),
    "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
}


class ServerError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type_: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = (
            status, message, param, type_, code)
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


class _Body(BaseModel):
    """A request body. OpenAI's API (and vLLM's) reads a field sent as null as one not sent,
    and clients send them so ("temperature": null): its default applies."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_not_sent(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data


class StreamOptions(BaseModel):
    include_usage: bool | None = None  # a last chunk of usage, as in OpenAI's API


class _Sampling(_Body):
    model_config = ConfigDict(extra="ignore")  # clients send fields we do not use

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    # vLLM: -1 or 0 mean no limit. The cap (above any vocabulary) keeps it an int64.
    top_k: int = Field(default=0, ge=-1, lt=2**31)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = Field(default=1, ge=1, le=1)  # one choice per request
    stream: bool = False
    user: str | None = None
    priority: int = 0  # vLLM: lower runs first; negative values are interactive
    request_class: Literal["interactive", "bulk"] | None = None
    stream_options: StreamOptions | None = None

    @model_validator(mode="before")
    @classmethod
    def _refuse_unused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, unused in _UNUSED.items():
                if name in data and data[name] not in unused:
                    raise ServerError(400, f"{name} is not supported by this server",
                                      name, code="unsupported_parameter")
        return data

    @field_validator("stop")
    @classmethod
    def _stops(cls, v):
        stops = [v] if isinstance(v, str) else list(v or [])
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise ValueError(f"stop takes 1 to {MAX_STOP_STRINGS} non-empty strings")
        return stops

    def scheduling_class(self) -> str:
        """RT (interactive, the default) or BE (bulk): request_class, else priority > 0."""
        if self.request_class is not None:
            return "RT" if self.request_class == "interactive" else "BE"
        return "BE" if self.priority > 0 else "RT"

    def sampling(self, default_max_tokens: int, logprobs: int | None) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_completion_tokens or self.max_tokens or default_max_tokens,
            temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0),
            seed=self.seed, stop=list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
            logprobs=logprobs)


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    prompt_logprobs: int | None = Field(default=None, ge=0, le=20)

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, v):
        """OpenAI takes a list of prompts (a choice each); one per request here."""
        if isinstance(v, list) and v and isinstance(v[0], str | list):
            if len(v) != 1:
                raise ValueError(f"one prompt per request here, not {len(v)}: send each "
                                 "in a request of its own")
            return v[0]
        return v


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    tool_calls: list[Any] | None = Field(default=None, exclude=True)  # (not for the template)
    # Checked when missing too: OpenAI's API requires it but beside tool_calls.
    content: str | list[TextPart] | None = Field(default=None, validate_default=True)

    @field_validator("role")
    @classmethod
    def _developer_is_system(cls, v: str) -> str:
        return "system" if v == "developer" else v  # (OpenAI's newer name for it)

    @field_validator("tool_calls")
    @classmethod
    def _no_tool_calls(cls, v: list | None) -> None:
        """Refused, not ignored: the model would see an empty assistant turn instead."""
        if v:
            raise PydanticCustomError("tool_calls", "tool calls are not supported by this server")

    @field_validator("content", mode="before")
    @classmethod
    def _present(cls, v: Any) -> Any:
        """OpenAI's API takes a null content only in an assistant message with tool_calls
        (refused above); other null contents reached the chat template, whose TypeError
        named neither the message nor the field."""
        if v is None:
            raise PydanticCustomError("content", "content must be text (null only in an "
                                      "assistant message with tool_calls)")
        return v

    @field_validator("content")
    @classmethod
    def _text(cls, v) -> str:
        """Content parts are text here: joined by newlines, as vLLM joins them."""
        return v if isinstance(v, str) else "\n".join(part.text for part in v)


class ChatTemplateOptions(_Body):
    """vLLM's options for how chat messages become the prompt."""

    model_config = ConfigDict(extra="ignore")

    add_generation_prompt: bool = True
    # The last (assistant) message is a start to go on from: no end of turn after it.
    continue_final_message: bool = False
    # More variables for the model's template, e.g. {"enable_thinking": true} for Qwen3.
    chat_template_kwargs: dict[str, Any] | None = None

    def template_options(self) -> dict[str, Any]:
        """ModelTokenizer.encode_chat's keyword arguments."""
        return {"add_generation_prompt": self.add_generation_prompt,
                "continue_final": self.continue_final_message,
                "template_kwargs": self.chat_template_kwargs}


class ChatCompletionRequest(_Sampling, ChatTemplateOptions):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)

    @model_validator(mode="before")
    @classmethod
    def _no_prompt_logprobs(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("prompt_logprobs") is not None:
            raise ServerError(400, "prompt_logprobs is available on /v1/completions only",
                              "prompt_logprobs", code="unsupported_parameter")
        return data

    @model_validator(mode="after")
    def _top_needs_logprobs(self):
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self


class TokenizeRequest(ChatTemplateOptions):
    """vLLM's /tokenize: a prompt, or chat messages under the model's template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self
