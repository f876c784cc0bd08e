"""The OpenAI API's schema as specrt serves it: the request models (OpenAI's fields that specrt serves, its
`specrt` extension field) and the errors, OpenAI's error objects."""
from __future__ import annotations

from typing import Annotated, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from specrt.decoding.generate import AUTO, METHODS
from specrt.decoding.sampling import ACCEPTANCE
from specrt.errors import InputError, SpecrtError

# ---- the request schema (OpenAI's fields that specrt serves; other fields are ignored) -----------------------------


class SpecrtOptions(BaseModel):
    """The `specrt` extension field of a request: how to speculate (generate()'s keyword arguments)."""
    model_config = ConfigDict(extra="forbid")
    method: Literal[(AUTO, *METHODS)] | None = None  # default: the server's --method
    top_k: int = Field(0, ge=0)
    gamma: int | None = Field(None, ge=1, le=64)
    tree: bool = False
    adaptive: bool = True
    acceptance: Literal[ACCEPTANCE] = "exact"  # typical: Medusa's typical acceptance, NOT the target's distribution


class StreamOptions(BaseModel):
    include_usage: bool = False


class BaseRequest(BaseModel):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)   # OpenAI's default 1.0; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1, max_length=16)
    stream: bool = False
    stream_options: StreamOptions | None = None
    specrt: SpecrtOptions = Field(default_factory=SpecrtOptions)


class CompletionRequest(BaseRequest):
    prompt: str | list[int]                         # text (no chat template) or token ids
    max_tokens: int | None = Field(16, ge=1)        # OpenAI's default for completions


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class Message(BaseModel):
    role: str
    content: str | list[TextPart] | None = None


class ChatRequest(BaseRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """OpenAI's error object: every answer that is not a 200."""
    error: ErrorDetail


ERRORS = {   # the statuses the API answers besides 200 (the OpenAPI document lists them)
    400: "Bad input: malformed JSON, a field's value, an unknown method, a prompt that does not fit.",
    401: "No valid API key (the server runs with --api-key).",
    404: "An unknown model.",
    413: "A body larger than --max-body-bytes.",
    429: "More requests waiting for a row than --max-waiting.",
    500: "The request failed in the engines (the server keeps serving).",
    503: "The server is shutting down, gave no token within --request-timeout, or its scheduler has died (it must be "
         "restarted).",
}


def error_responses(*statuses: int) -> dict:
    return {status: {"model": ErrorResponse, "description": ERRORS[status]} for status in statuses}


class APIError(Exception):
    """An answer in OpenAI's error format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.message, self.param, self.code, self.status), status_code=self.status)


def error_body(message: str, param: str | None = None, code: str | None = None, status: int = 400) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def api_error(e: Exception) -> APIError:
    """Any exception as the error a client gets: an InputError is a 400, anything else a 500 that names it."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, InputError):
        return APIError(400, str(e))
    if isinstance(e, SpecrtError):
        return APIError(500, str(e))
    return APIError(500, f"the server failed on this request: {type(e).__name__}: {e} (its log has the details)")



def param_of(loc: tuple) -> str | None:
    """The field a validation error is about, as OpenAI names it: `messages[0].content` (no union branch names)."""
    param = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            param += f"[{part}]"
        elif part.isidentifier() and part not in ("str", "int", "float", "bool"):
            param += f".{part}" if param else part
        else:
            break
    return param or None

