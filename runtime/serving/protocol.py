"""The OpenAI API's schema as specrt serves it: the request models (OpenAI's fields that specrt serves, those it
accepts with no effect, vLLM's extensions, its own `specrt` field; structured output's response_format and vLLM's
guided_regex / guided_grammar; tools and tool_choice), the fields it refuses by name (`refused`: a field served moves
from REFUSED into its model), and the errors, OpenAI's error objects."""
from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_core import PydanticCustomError

from specrt.decoding.generate import AUTO, METHODS
from specrt.decoding.sampling import ACCEPTANCE
from specrt.errors import InputError, SpecrtError

# ---- the request schema ----------------------------------------------------------------------------------------------
# Every field a request may carry is declared: served, or accepted with no effect (NO_EFFECT in its description). Any
# other field is a 400 that names it: one of `refused` with the reason (not served, or not yet), else an unknown one.
# The OpenAPI document is made from these models, so it says what is served.

NO_EFFECT = "Accepted; no effect on the answer."
LOGPROBS_MAX = 20   # alternatives per token (OpenAI's top_logprobs bound; the loop's MAX_LOGPROBS)
TEMPERATURE_MAX = 2.0   # OpenAI's bound: above it the distribution is noise, and 1/T underflows near float32's end
STOP_MAX, STOP_CHARS = 16, 256   # stop strings: how many, and the characters of each (a delimiter, never a text: the
                                 # held-back tail a piece is checked against is at most STOP_CHARS - 1 characters)
CACHE_SALT_CHARS = 256   # cache_salt: a tenant's or a user's name for its prefix cache partition
TEMPLATE_KWARGS_MAX, TEMPLATE_KWARG_CHARS = 16, 1024   # chat_template_kwargs: how many, a string value's characters
TEMPLATE_KWARG_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,63}")
# the chat template's own arguments and variables (apply_chat_template's, the tokenizer's special tokens, Jinja's
# globals): a request's chat_template_kwargs may not set them
TEMPLATE_ARGUMENTS = frozenset({
    "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "add_special_tokens", "raise_exception", "strftime_now",
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
    "additional_special_tokens", "range", "dict", "lipsum", "cycler", "joiner", "namespace"})


class Forbid(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpecrtOptions(Forbid):
    """The `specrt` extension field of a request: how to speculate (generate()'s keyword arguments)."""
    method: Literal[(AUTO, *METHODS)] | None = None  # default: the server's --method
    top_k: int = Field(0, ge=0, description="The same as the top-level top_k (0: off).")
    gamma: int | None = Field(None, ge=1, le=64)
    tree: bool = False
    adaptive: bool = True
    acceptance: Literal[ACCEPTANCE] = "exact"  # typical: Medusa's typical acceptance, NOT the target's distribution
    rounds: bool = Field(False, description="Streamed: each chunk's `specrt.rounds` says what the rounds that made "
                         "its tokens drafted, accepted and corrected (docs/serving.md). Off: OpenAI's chunks alone.")


class StreamOptions(Forbid):
    include_usage: bool = False
    include_obfuscation: bool | None = Field(None, description=NO_EFFECT)


class JsonSchema(Forbid):
    """response_format's json_schema: OpenAI's shape. The schema is always enforced (`strict` or not)."""
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema", description="A JSON schema (llguidance's "
                                    "subset: a keyword it does not implement is a 400).")
    strict: bool | None = Field(None, description="Accepted; the schema is always enforced.")


class ResponseFormat(Forbid):
    """The answer's format: plain text (the default), any JSON object, or JSON that follows `json_schema.schema`;
    the output is constrained by a grammar at every token, with every method."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = Field(None, description="Needed by (and only with) type json_schema.")


TokenId = Annotated[str, Field(pattern=r"^[0-9]{1,9}$")]   # logit_bias's keys: token ids as JSON's string keys
Bias = Annotated[float, Field(ge=-100, le=100)]
StopString = Annotated[str, Field(min_length=1, max_length=STOP_CHARS)]


class BaseRequest(Forbid):
    """The fields both endpoints take."""
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=TEMPERATURE_MAX)   # OpenAI's default 1.0; 0 is greedy
    top_p: float | None = Field(None, gt=0, le=1)
    seed: int | None = Field(None, ge=0, lt=2 ** 63)
    n: int = Field(1, ge=1, le=64)
    stop: StopString | Annotated[list[StopString], Field(min_length=1, max_length=STOP_MAX)] | None = Field(
        None, description=f"Up to {STOP_MAX} strings of 1 to {STOP_CHARS} characters: the text ends before the first "
        "of them to come.")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[TokenId, Bias] | None = Field(None, max_length=1024)
    user: str | None = Field(None, description=NO_EFFECT)
    # vLLM's extensions, top level as vLLM takes them
    top_k: int | None = Field(None, ge=-1, description="Sample from the k most likely tokens (0 or -1: off).")
    min_p: float | None = Field(None, ge=0, le=1, description="Drop tokens below min_p times the most likely one's "
                                                               "probability (0: off).")
    repetition_penalty: float | None = Field(None, ge=0.01, le=100, description="Divide the logits of the tokens "
                                             "of the prompt and the output so far by it where positive, multiply "
                                             "where negative (1: off).")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=64, description="Stop after "
                                                                    "any of these tokens (it is in token_ids, not "
                                                                    "in the text).")
    specrt: SpecrtOptions = Field(default_factory=SpecrtOptions)

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_chars(cls, stop):
        """A stop string beyond STOP_CHARS, named with its length (before the union's branches each say theirs)."""
        for i, s in enumerate([stop] if isinstance(stop, str) else stop if isinstance(stop, list) else []):
            if isinstance(s, str) and len(s) > STOP_CHARS:
                raise PydanticCustomError("string_too_long", "{where} has {chars} characters: a stop string has at "
                                          "most {limit} (a delimiter, not a text); shorten it",
                                          {"where": "stop" if isinstance(stop, str) else f"stop[{i}]", "chars": len(s),
                                           "limit": STOP_CHARS})
        return stop

    cache_salt: str | None = Field(None, min_length=1, max_length=CACHE_SALT_CHARS, description="vLLM's: the prefix "
                                   "cache's partition within the API key's; a request reuses only the cached prompts "
                                   "of requests with the same key and salt (and its cached_tokens count only them).")
    # structured output: OpenAI's response_format, vLLM's guided_regex / guided_grammar extensions (one at most)
    response_format: ResponseFormat | None = None
    guided_regex: str | None = Field(None, description="The whole output matches this regular expression (Rust "
                                     "regex syntax).")
    guided_grammar: str | None = Field(None, description="The output follows this context-free grammar: "
                                       "llguidance's Lark dialect (`start: ...`) or llama.cpp's GBNF (`root ::= "
                                       "...`).")

    # fields that OpenAI's API has and this server does not serve (yet): a 400 that says so. `refused` reads the raw
    # body, before the model validates it (values a field takes but does not serve fail its validation too)
    REFUSED: ClassVar[dict[str, str]] = {}

    @classmethod
    def refused(cls, body: dict) -> tuple[str, str] | None:
        """(param, why) of the first field or value of `body` that this endpoint does not serve, else None."""
        for name, why in cls.REFUSED.items():
            if body.get(name) is not None:
                return name, why
        return None


class CompletionRequest(BaseRequest):
    prompt: str | list[int]                         # text (no chat template) or token ids
    max_tokens: int | None = Field(16, ge=1)        # OpenAI's default for completions
    logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX, description="Each token's log-probability and this "
                                 "many alternatives (with the chosen token's, up to N + 1).")
    echo: Literal[False] | None = Field(None, description="Only false: the answer holds the completion alone.")
    best_of: int | None = Field(None, ge=1, le=64, description="Only equal to n (no effect).")
    REFUSED: ClassVar[dict[str, str]] = {
        "suffix": "insertion (a text after the completion) is not served",
    }

    @classmethod
    def refused(cls, body: dict) -> tuple[str, str] | None:
        if body.get("echo") is True:
            return "echo", "not served: the answer holds the completion alone; prepend the prompt yourself"
        return super().refused(body)


class TextPart(Forbid):
    type: Literal["text"]
    text: str


FunctionName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class Function(Forbid):
    name: FunctionName
    description: str | None = None
    parameters: dict[str, Any] | None = Field(None, description="Its arguments' JSON schema (default: any object).")
    strict: bool | None = Field(None, description="Accepted; a forced call always follows the schema.")


class Tool(Forbid):
    type: Literal["function"]
    function: Function


class ChosenFunction(Forbid):
    name: FunctionName


class NamedToolChoice(Forbid):
    type: Literal["function"]
    function: ChosenFunction


class CalledFunction(Forbid):
    name: str
    arguments: str = Field(description="The arguments as a JSON string, as the model wrote them.")


class ToolCall(Forbid):
    id: str
    type: Literal["function"]
    function: CalledFunction


class Message(Forbid):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = Field(None, description="Given to the model's chat template, which may use it or not.")
    tool_calls: list[ToolCall] | None = Field(None, description="An assistant's earlier calls (role assistant).")
    tool_call_id: str | None = Field(None, description="The call a tool's result answers (role tool).")


class ChatRequest(BaseRequest):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = Field(False, description="Each token's log-probability (choices[i].logprobs.content).")
    top_logprobs: int | None = Field(None, ge=0, le=LOGPROBS_MAX, description="Alternatives per token (needs "
                                     "logprobs: true).")
    tools: list[Tool] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(None, description="none: "
        "a text answer (the tools are not shown to the model); auto (the default with tools): the model answers "
        "freely until it opens a call in its chat template's format, which then follows the tools' schemas; "
        "required, or a named function: the reply is calls (of that function), nothing else.")
    modalities: list[Literal["text"]] | None = Field(None, description="Only [\"text\"].")
    metadata: dict[str, str] | None = Field(None, description=NO_EFFECT)
    store: bool | None = Field(None, description=NO_EFFECT)
    service_tier: str | None = Field(None, description=NO_EFFECT)
    parallel_tool_calls: bool | None = Field(None, description="With tools: several calls in one answer (the "
                                             "default); false: one at most. Without tools, no effect.")
    safety_identifier: str | None = Field(None, description=NO_EFFECT)
    prompt_cache_key: str | None = Field(None, description=NO_EFFECT)
    prompt_cache_retention: str | None = Field(None, description=NO_EFFECT)
    chat_template_kwargs: dict[str, Any] | None = Field(None, description=f"vLLM's: variables for the model's chat "
        f"template, e.g. {{\"enable_thinking\": false}}; up to {TEMPLATE_KWARGS_MAX} names, each a JSON scalar "
        f"(a string of at most {TEMPLATE_KWARG_CHARS} characters, a number, a boolean, null), none of the template's "
        "own arguments (messages, tools, add_generation_prompt, the special tokens...).")

    @field_validator("chat_template_kwargs", mode="before")
    @classmethod
    def _template_kwargs(cls, kwargs):
        """Each name and value bounded and a JSON scalar; none of the template's own arguments."""
        def bad(message: str, **ctx):
            return PydanticCustomError("chat_template_kwargs", message, ctx)

        if kwargs is None:
            return None
        if not isinstance(kwargs, dict):
            raise bad("expected an object of names to values, e.g. {example}", example='{"enable_thinking": false}')
        if len(kwargs) > TEMPLATE_KWARGS_MAX:
            raise bad("{count} names: at most {limit}; give the template only the variables it reads",
                      count=len(kwargs), limit=TEMPLATE_KWARGS_MAX)
        for key, value in kwargs.items():
            if not TEMPLATE_KWARG_NAME.fullmatch(key):
                raise bad("the name {key} is not a template variable's: letters, digits and _, at most 64, not "
                          "beginning with a digit", key=repr(key[:80]))
            if key in TEMPLATE_ARGUMENTS:
                raise bad("{key}: the server gives the chat template this argument itself; leave it out (tools and "
                          "messages are the request's own fields)", key=key)
            if value is not None and not isinstance(value, (bool, int, float, str)):
                raise bad("{key}: a {kind}; a template variable here is a JSON scalar (a string, number, boolean or "
                          "null)", key=key, kind=type(value).__name__)
            if isinstance(value, str) and len(value) > TEMPLATE_KWARG_CHARS:
                raise bad("{key}: {chars} characters; a string here has at most {limit} (the messages carry text)",
                          key=key, chars=len(value), limit=TEMPLATE_KWARG_CHARS)
        return kwargs

    REFUSED: ClassVar[dict[str, str]] = {
        "functions": "the deprecated function calls are not served: use tools and tool_choice",
        "function_call": "the deprecated function calls are not served: use tools and tool_choice",
        "audio": "audio output is not served: specrt answers in text",
        "prediction": "predicted outputs are not served (specrt speculates with its own drafters: the `specrt` "
                      "field's method)",
        "reasoning_effort": "reasoning effort is not served: the model answers as it does",
        "verbosity": "verbosity is not served: the model answers as it does",
        "web_search_options": "web search is not served",
        "moderation": "moderation is not served",
    }

    @classmethod
    def refused(cls, body: dict) -> tuple[str, str] | None:
        modalities = body.get("modalities")
        if isinstance(modalities, list) and any(m != "text" for m in modalities):
            return "modalities", f"{modalities}: only [\"text\"] is served"
        messages = body.get("messages")
        for i, message in enumerate(messages if isinstance(messages, list) else []):
            if not isinstance(message, dict):
                continue
            if message.get("function_call") is not None:
                return f"messages[{i}].function_call", "the deprecated function calls are not served: use tool_calls"
            if message.get("audio") is not None:
                return f"messages[{i}].audio", "audio is not served: specrt reads and answers text"
            if isinstance(message.get("content"), list):
                for j, part in enumerate(message["content"]):
                    kind = part.get("type") if isinstance(part, dict) else None
                    if kind not in (None, "text"):
                        return f"messages[{i}].content[{j}].type", f"{kind!r} content is not served: text only"
        return super().refused(body)


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



def invalid(model: type[BaseRequest] | None, body, errors: list[dict]) -> APIError:
    """A body that does not validate, as a 400 that names the field: malformed JSON; a field or value this endpoint
    does not serve (`model.refused`); an unknown field; else the first field whose value is wrong."""
    if errors[0]["type"] == "json_invalid":
        return APIError(400, f"malformed JSON body: {errors[0]['msg']} ({errors[0].get('ctx', {}).get('error', '')})",
                        None, "invalid_json")
    if model is not None and isinstance(body, dict) and (refused := model.refused(body)) is not None:
        param, why = refused
        return APIError(400, f"{param}: {why}", param, "unsupported_parameter")
    unknown = [err for err in errors if err["type"] == "extra_forbidden"]
    if unknown:
        param = param_of(unknown[0]["loc"])
        return APIError(400, f"{param}: an unknown field; this server takes OpenAI's fields that it serves, some "
                             "with no effect, and refuses any other by name (its /openapi.json lists them)", param,
                        "unknown_parameter")
    param = param_of(errors[0]["loc"])
    msgs = dict.fromkeys(err["msg"] for err in errors if param_of(err["loc"]) == param)   # a union's branches
    return APIError(400, f"{param or 'body'}: {' or '.join(msgs)}", param)
