"""The OpenAI HTTP API's request bodies as pydantic models, and the error object.

DESIGN.md "Real parts" (the server speaks the OpenAI HTTP API); CS336 notes "推理流程" (a request is
a prompt plus the sampling rules). Field names, types and ranges follow the OpenAI reference for
``/v1/completions`` and ``/v1/chat/completions``; lmstack's extra sampling fields (``top_k``,
``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``) come as extra body fields
(``extra_body=`` in the ``openai`` client). Unknown fields are ignored, as most servers do.
Responses are plain dicts built in ``app.py`` (their shapes are OpenAI's, checked by the client).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

MAX_STOP = 4  # OpenAI: up to 4 stop sequences


def _encodable(s: str) -> str:
    """JSON may carry a lone UTF-16 surrogate (``"\\ud800"``) that no UTF-8 text can hold: refuse it here (400
    naming the field) rather than fail in the tokenizer (a 500)."""
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(
            f"contains a lone surrogate {s[e.start]!r} at index {e.start}: not valid Unicode text"
        ) from None
    return s


#: a string that must be valid Unicode (every text the tokenizer or the detokenizer's caller will read)
Text = Annotated[str, AfterValidator(_encodable)]


def error_body(
    message: str,
    type_: str = "invalid_request_error",
    param: str | None = None,
    code: str | None = None,
) -> dict:
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(_Request):
    include_usage: bool = False


class FunctionDef(_Request):
    """A tool's function: its name (checked in ``tools.py``: ``^[a-zA-Z0-9_-]{1,64}$``, unique), and the JSON
    schema of its arguments object (absent = no arguments)."""

    name: str
    description: str | None = None
    parameters: Any = None
    strict: bool | None = None


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class FunctionName(_Request):
    name: str


class NamedToolChoice(_Request):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call exactly that tool."""

    type: Literal["function"]
    function: FunctionName


class FunctionCall(_Request):
    name: Text
    arguments: Text  # a JSON object, as a string (OpenAI's format)


class ToolCall(_Request):
    """An earlier assistant turn's call, sent back in ``messages``."""

    id: Text
    type: Literal["function"] = "function"
    function: FunctionCall


class Sampling(_Request):
    """Fields shared by both endpoints."""

    model: str
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: (
        Annotated[Text, Field(min_length=1)]
        | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(max_length=MAX_STOP)]
        | None
    ) = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    user: str | None = None
    # lmstack extras (extra_body)
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=100)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    # tool calls (chat only: ``serve/tools.py``; /v1/completions refuses them)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # OpenAI fields this server does not implement: accepted only at their no-op values (``Server.unsupported``),
    # anything else is a 400 naming the field — never a plain-text answer pretending to comply
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    audio: Any = None
    best_of: Annotated[int, Field(ge=1)] | None = None


class CompletionRequest(Sampling):
    """``POST /v1/completions``: a prompt is a string, a list of strings, token ids, or a list of those.
    ``echo`` with ``logprobs`` returns the prompt tokens' log-probabilities too (the first one null), as
    OpenAI's legacy API and vLLM do; lm-eval's ``local-completions`` asks for log-likelihoods that way
    (``max_tokens=1``, then it keeps the continuation's slice). ``max_tokens=0`` with ``echo`` only scores the
    prompt (not streamed)."""

    prompt: Text | list[Text] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=0)] | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None
    suffix: Text | None = None


class TextPart(_Request):
    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant turn that called tools
    tool_call_id: Text | None = None  # a tool turn: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        return (
            self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        )


class JsonSchema(_Request):
    name: str = "response"
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None


class ChatCompletionRequest(Sampling):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None


class TokenizeRequest(_Request):
    """``POST /tokenize``: a text prompt, or chat messages rendered with the model's template."""

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0)]]
