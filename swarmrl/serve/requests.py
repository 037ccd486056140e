"""The request bodies `swarmrl serve` accepts, as pydantic models (the orchestrator's style): the
shape and the fixed ranges of every field, unknown fields refused. What depends on the server
(the model's name and context, `--max-n`) and what OpenAI accepts but this server refuses on
purpose (top_p, top_k, penalties, logit_bias, echo, suffix) is checked by the routes after
parsing, so that each refusal names its parameter.

Completions also take vLLM's extensions that an RL worker needs (docs/engines.md): `prompt` as a
list of token ids, `return_tokens_as_token_ids` (logprob tokens spelled "token_id:ID") and
`return_token_ids` (each choice carries its `token_ids`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr, ValidationError

MAX_STOP = 4
MAX_TOP_LOGPROBS = 20
_Number = StrictFloat | StrictInt  # JSON numbers; true/false and strings are refused


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "user", "assistant"]
    content: StrictStr


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: StrictStr | None = None
    max_tokens: StrictInt | None = Field(None, ge=1, le=1 << 30)
    temperature: _Number | None = Field(None, ge=0, le=2)
    seed: StrictInt | None = Field(None, ge=0, lt=1 << 63)
    n: StrictInt | None = Field(None, ge=1)
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP)] | None = None
    stream: StrictBool | None = None
    stream_options: StreamOptions | None = None
    top_p: _Number | None = None
    top_k: StrictInt | None = None  # vLLM's and SGLang's extension; only "off" (-1 or 0) is accepted
    frequency_penalty: _Number | None = None
    presence_penalty: _Number | None = None
    user: StrictStr | None = None
    logit_bias: dict | None = None
    best_of: StrictInt | None = Field(None, ge=1)

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    # A string, or token ids (vLLM accepts both; [[ids]] and [string] for one prompt too).
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    echo: StrictBool | None = None
    suffix: StrictStr | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    return_tokens_as_token_ids: StrictBool | None = None  # vLLM: logprob tokens as "token_id:ID"
    return_token_ids: StrictBool | None = None  # vLLM and SGLang: each choice's `token_ids`


class ChatRequest(_Common):
    messages: list[Message] = Field(min_length=1)
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    max_completion_tokens: StrictInt | None = Field(None, ge=1, le=1 << 30)


# What each field must be, said the way a client can act on it.
_EXPECTED = {
    "max_tokens": "an integer between 1 and 1073741824",
    "max_completion_tokens": "an integer between 1 and 1073741824",
    "temperature": "a number between 0 and 2",
    "seed": "a non-negative integer below 2**63",
    "n": "a positive integer",
    "best_of": "a positive integer",
    "stop": f"a non-empty string or a list of up to {MAX_STOP}",
    "stream": "true or false",
    "echo": "true or false",
    "stream_options": '{"include_usage": true|false}',
    "logprobs": f"an integer between 0 and {MAX_TOP_LOGPROBS} (completions) or true/false (chat)",
    "top_logprobs": f"an integer between 0 and {MAX_TOP_LOGPROBS}",
    "prompt": "a string or a list of token ids (one prompt per request)",
    "top_k": "an integer (only -1 or 0, no top-k cut, is supported)",
    "return_tokens_as_token_ids": "true or false",
    "return_token_ids": "true or false",
    "messages": "a non-empty list of {'role': system|user|assistant, 'content': a string}",
}


def describe(exc: ValidationError, body: dict) -> tuple[str, str | None]:
    """(message, param) for the first problem pydantic found, in the words of `_EXPECTED`."""
    error = exc.errors()[0]
    loc = error.get("loc") or ()
    param = str(loc[0]) if loc else None
    if error.get("type") == "extra_forbidden" and len(loc) == 1:
        unknown = sorted(set(body) - set(CompletionRequest.model_fields) - set(ChatRequest.model_fields)) or [param]
        return f"unrecognized request argument(s): {', '.join(unknown)}", unknown[0]
    if param == "messages" and len(loc) > 1:
        return f"messages[{loc[1]}] must be {{'role': system|user|assistant, 'content': a string}}", param
    expected = _EXPECTED.get(param or "", str(error.get("msg", "invalid")))
    got = repr(body.get(param))[:100] if param in body else "nothing"
    return f"'{param}' must be {expected}, got {got}", param


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's route): how many tokens a prompt or a chat is for this model, so a
    client can size max_tokens to the room the context leaves (`swarmrl eval --endpoint` does)."""

    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = None
    prompt: StrictStr | None = None
    messages: list[Message] | None = Field(None, min_length=1)
    add_generation_prompt: StrictBool = True
