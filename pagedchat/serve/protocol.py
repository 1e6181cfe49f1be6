"""The request bodies, in OpenAI's and vLLM's field names, and their sampling parameters."""

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pagedchat.engine.api.params import SamplingParams

log = logging.getLogger(__name__)


class ApiError(Exception):
    """An error answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param

    def body(self) -> dict:
        kind = {400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError",
                503: "ServiceUnavailableError"}.get(self.status, "BadRequestError" if self.status < 500
                                                    else "InternalServerError")
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": self.status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]] | None = ""

    def text(self) -> str:
        """The content; a list of parts must be text parts only."""
        if isinstance(self.content, list):
            if any(part.get("type") != "text" for part in self.content):
                raise ApiError(400, "only text content parts are supported", "messages")
            return "".join(part.get("text", "") for part in self.content)
        return self.content or ""


class Completion(BaseModel):
    """What /v1/completions and /v1/chat/completions share."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = Field(default=0, ge=-1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM's extras
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    return_token_ids: bool = False
    session_id: str | None = None
    # checked by SamplingParams (a bad value is a 400)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # accepted only while they ask for nothing
    logprobs: bool | int | None = None
    tools: list | None = None
    response_format: dict | None = None

    def refuse_what_cannot_be_honoured(self) -> None:
        asked = {
            "logprobs": self.logprobs not in (None, False, 0),
            "tools": bool(self.tools),
            "response_format": self.response_format not in (None, {"type": "text"}),
        }
        for name, wanted in asked.items():
            if wanted:
                raise ApiError(400, f"{name} is not supported by this server", name)
        if self.model_extra:
            log.warning("ignoring unknown fields: %s", ", ".join(sorted(self.model_extra)))

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def sampling_params(self, room: int) -> SamplingParams:
        """`room`: the tokens left in the context after the prompt, the default and the most for max_tokens."""
        max_tokens = self.requested_max_tokens
        if max_tokens is not None and max_tokens > room:
            raise ApiError(400, f"max_tokens is {max_tokens}, but the context has room for {room} more "
                                "tokens after the prompt", "max_tokens")
        try:
            return SamplingParams(
                n=self.n, temperature=self.temperature, top_p=self.top_p, top_k=max(self.top_k, 0), seed=self.seed,
                max_tokens=max_tokens or room, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
                repetition_penalty=self.repetition_penalty, presence_penalty=self.presence_penalty,
                frequency_penalty=self.frequency_penalty,
            )
        except ValueError as exc:
            raise ApiError(400, str(exc)) from exc

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens


class ChatCompletion(Completion):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TextCompletion(Completion):
    prompt: str | list[int] | list[str] | list[list[int]]

    def prompt_one(self) -> str | list[int]:
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ApiError(400, "give one prompt per request", "prompt")
            prompt = prompt[0]
        if not prompt:
            raise ApiError(400, "the prompt is empty", "prompt")
        return prompt


class Tokenize(BaseModel):
    model_config = ConfigDict(extra="ignore")

    prompt: str | None = None
    messages: list[Message] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class Detokenize(BaseModel):
    model_config = ConfigDict(extra="ignore")

    tokens: list[int]
