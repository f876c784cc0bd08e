"""OpenAI's answers (vLLM's serving_completion / serving_chat): a request's options for the generator (its grammar
and tools included), its tokens from the scheduler, text cut at stop strings, and the answer: a completion, tool calls,
or server-sent events in OpenAI's chunk format."""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from functools import partial

import jinja2
from fastapi.responses import StreamingResponse

from specrt.decoding.generate import AUTO, METHODS, Generator
from specrt.decoding.grammar import Grammar, library as grammar_library
from specrt.decoding.processors import Penalties
from specrt.decoding.run import MODEL_FREE
from specrt.decoding.sampling import SamplingParams
from specrt.errors import InputError
from specrt.serving.logprobs import CompletionLogprobs, TokenTexts, chat_logprobs
from specrt.serving.metrics import Metrics
from specrt.serving.protocol import (APIError, BaseRequest, ChatRequest, Message, NamedToolChoice,
                                     api_error, error_body)
from specrt.serving import reasoning as reasoning_parsers
from specrt.serving.reasoning import Thinking
from specrt.serving.scheduler import Job, Scheduler
from specrt.serving.tool_parsers import AUTO as AUTO_FORMAT, FORMATS, CallReader, ToolFormat, detect

# ---- text with stop strings ----------------------------------------------------------------------------------------


class StopText:
    """Text as it grows, cut at the first stop string; holds back a tail that could begin one. Incremental: a piece
    costs O(len(piece) x stops), whatever came before. Each stop string keeps its Knuth-Morris-Pratt state (the
    longest prefix of it that the text ends with): the tail held back is the longest of them, at most the longest
    stop string's length - 1 characters, and a stop string that comes must end in the new piece, so only the piece and
    that tail are searched."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.fail = [_prefix_function(s) for s in stops]
        self.state = [0] * len(stops)
        self.tail = ""   # the text held back (not sent yet)

    def feed(self, new: str) -> tuple[str, bool]:
        """The text that is safe to send now, and whether a stop string has come (the text ends before it)."""
        text = self.tail + new
        found = [text.find(s, max(0, len(self.tail) - len(s) + 1)) for s in self.stops]   # ending in `new`
        cut = min((i for i in found if i >= 0), default=None)
        if cut is not None:
            self.tail = ""
            return text[:cut], True
        for k, s in enumerate(self.stops):
            self.state[k] = _advance(s, self.fail[k], self.state[k], new)
        hold = max(self.state, default=0)
        out, self.tail = text[:len(text) - hold], text[len(text) - hold:]
        return out, False

    def flush(self) -> str:
        out, self.tail = self.tail, ""
        return out


def _prefix_function(s: str) -> list[int]:
    """KMP's failure function: fail[i], the longest proper prefix of s[:i + 1] that is also its suffix."""
    fail, k = [0] * len(s), 0
    for i in range(1, len(s)):
        while k and s[i] != s[k]:
            k = fail[k - 1]
        k += s[i] == s[k]
        fail[i] = k
    return fail


def _advance(s: str, fail: list[int], k: int, new: str) -> int:
    """The longest prefix of s (shorter than s) that the text ends with, once `new` follows a text that ended with
    s[:k]. It depends on the last len(s) - 1 characters alone: a longer `new` is read from there."""
    if len(new) >= len(s) - 1:
        k, new = 0, new[len(new) - len(s) + 1:] if len(s) > 1 else ""
    for c in new:
        while k and (k == len(s) or s[k] != c):
            k = fail[k - 1]
        k += s[k] == c
    return min(k, len(s) - 1)


def _finish(stop_reason: str | None) -> str:
    return "stop" if stop_reason in ("eos", "stop_token") else "length"


@dataclass
class Piece:
    """What a round added to one sequence: its text (cut at a stop string), token ids, their TokenLogprobs (None:
    not asked for), at its end the finish reason and the sequence's figures, its tool calls if it is one, and the
    rounds that made it when asked for (the streaming extension `specrt.rounds`)."""
    text: str | None
    ids: list[int]
    logprobs: list | None = None
    reason: str | None = None
    stats: dict | None = None
    calls: list[dict] | None = None
    rounds: list[dict] | None = None   # the rounds that made its tokens (specrt.rounds), None: not asked for
    reasoning: str | None = None       # its text that is reasoning (serving.reasoning), taken out of `text`


# ---- tool calls ----------------------------------------------------------------------------------------------------
# A call is written in the chat template's format (tool_parsers.FORMATS). A template that takes `tools` sees them
# there; any other sees them in a system message (TOOLS_PROMPT), its earlier calls written in the format in its turns.

TOOLS_PROMPT = "You can call these functions:\n{tools}\nTo call one, answer with only {call}."


@dataclass(frozen=True)
class Tools:
    """A chat request's tools as its answer uses them: OpenAI's tool objects for the prompt, the names a reply may
    call, the format its calls are written in, whether it may make several (parallel_tool_calls), whether it must
    make one (`forced`: required or a named function), and the grammar its reply follows (Lark: ToolFormat.grammar)."""
    shown: list[dict]
    names: frozenset[str]
    format: ToolFormat
    parallel: bool
    forced: bool
    grammar: str

    def reader(self) -> CallReader:
        return CallReader(self.format, self.names, self.parallel)


def tool_use(req: ChatRequest, fmt: ToolFormat = FORMATS["json"], specials: frozenset[str] = frozenset()) \
        -> Tools | None:
    """The request's tools (None: no tools, or tool_choice none: a text answer, the tools not shown), their calls
    written in `fmt`; `specials`: the format's markers that are tokens of the tokenizer (ToolFormat.grammar)."""
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise APIError(400, f"tool_choice {choice if isinstance(choice, str) else choice.function.name!r}: "
                                "needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    functions = {tool.function.name: tool.function for tool in req.tools}
    if len(functions) < len(req.tools):
        raise APIError(400, "tools: two tools have the same name", "tools")
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in functions:
            raise APIError(400, f"tool_choice {choice.function.name!r}: not one of the tools "
                                f"({', '.join(functions)})", "tool_choice")
        called = [functions[choice.function.name]]
    else:
        called = list(functions.values())
    forced = choice is not None and choice != "auto"
    parallel = req.parallel_tool_calls is not False
    return Tools([tool.model_dump(exclude_none=True) for tool in req.tools], frozenset(functions), fmt, parallel,
                 forced, fmt.grammar(called, forced, parallel, specials))


def tool_answer(tools: Tools, text: str, reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
    """A whole reply as OpenAI answers it with tools: its content (None: calls alone), its calls (None: none) and
    finish reason ("tool_calls" where it made calls and ended by itself)."""
    reader = tools.reader()
    content = reader.feed(text)[0] + reader.end()
    calls = reader.calls or None
    return (content or None) if calls else content, calls, "tool_calls" if calls and reason == "stop" else reason


def _turn(message: Message, native: bool, fmt: ToolFormat) -> dict:
    """A message as the chat template takes it; without a template that knows tools, earlier calls are written as
    the reply that made them (in `fmt`)."""
    content = message.content if not isinstance(message.content, list) else "".join(p.text for p in message.content)
    turn = {"role": message.role, "content": content} | ({"name": message.name} if message.name is not None else {})
    calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)}
             for c in message.tool_calls or []]
    if native:
        if calls:
            turn["tool_calls"] = [{"id": c.id, "type": "function", "function": call}
                                  for c, call in zip(message.tool_calls, calls)]
        if message.tool_call_id is not None:
            turn["tool_call_id"] = message.tool_call_id
    elif calls or content is None:
        written = fmt.separator.join(fmt.write(c["name"], c["arguments"]) for c in calls)
        turn["content"] = "\n".join([*([content] if content else []), *([written] if written else [])])
    return turn


def message_chars(message: Message) -> int:
    """The characters of a message's free text, all that its turn gives the chat template: role, content, name,
    earlier calls (ids, names, arguments) and the call a tool's result answers (Server.check_chars bounds them)."""
    content = message.content if isinstance(message.content, str) else \
        "".join(p.text for p in message.content or [])
    calls = sum(len(c.id) + len(c.function.name) + len(c.function.arguments) for c in message.tool_calls or [])
    return len(message.role) + len(content) + len(message.name or "") + len(message.tool_call_id or "") + calls


def _arguments(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


def _joined(lists) -> list | None:
    """Pieces' lists (logprobs, rounds) one after another; None where none of the pieces has one (not asked for)."""
    lists = list(lists)
    return None if all(x is None for x in lists) else [item for x in lists for item in x or []]


def _with_calls(pieces: AsyncIterator[Piece], tools: Tools) -> AsyncIterator[Piece]:
    """A stream's pieces with tool calls: each piece's text read for calls (CallReader), its content and its calls'
    deltas as they come; the last piece's finish reason "tool_calls" where the reply made calls and ended by
    itself."""
    reader = tools.reader()

    def read(piece: Piece) -> Piece:
        content, deltas = reader.feed(piece.text or "")
        reason = piece.reason
        if reason is not None:
            content += reader.end()
            reason = "tool_calls" if reader.calls and reason == "stop" else reason
        return replace(piece, text=content, reason=reason, calls=deltas or None)
    return _each(pieces, read)


def _with_reasoning(pieces: AsyncIterator[Piece], thinking: Thinking) -> AsyncIterator[Piece]:
    """A stream's pieces with the reasoning taken out of their text (ReasoningReader), as each piece's `reasoning`."""
    reader = thinking.reader()

    def read(piece: Piece) -> Piece:
        reasoning, content = reader.feed(piece.text or "")
        if piece.reason is not None:
            more, rest = reader.end()
            reasoning, content = reasoning + more, content + rest
        return replace(piece, text=content, reasoning=reasoning or None)
    return _each(pieces, read)


async def _each(pieces: AsyncIterator[Piece], read) -> AsyncIterator[Piece]:
    """Each of `pieces` as `read` rewrites it; `pieces` closed at the end."""
    try:
        async for piece in pieces:
            yield read(piece)
    finally:
        await pieces.aclose()


async def _chained(first: Piece, pieces: AsyncIterator[Piece]) -> AsyncIterator[Piece]:
    """`first`, then the rest of `pieces`."""
    try:
        yield first
        if first.reason is None:
            async for piece in pieces:
                yield piece
    finally:
        await pieces.aclose()


# ---- the server ----------------------------------------------------------------------------------------------------


class Server:
    """One generator, its scheduler, the answers."""

    def __init__(self, gen: Generator, model_name: str, method: str = AUTO, max_batch: int = 8,
                 max_waiting: int | None = None, request_timeout: float | None = None, tool_parser: str = AUTO_FORMAT,
                 reasoning_parser: str = reasoning_parsers.AUTO):
        self.gen, self.model_name = gen, model_name
        if tool_parser != AUTO_FORMAT and tool_parser not in FORMATS:
            raise InputError(f"tool parser {tool_parser!r}: expected {AUTO_FORMAT} or one of {', '.join(FORMATS)}")
        tok = gen.tokenizer
        # the format of tool calls (from the chat template unless asked) and which of its markers are tokens
        self.tool_format = detect(tok.chat_template if tok is not None else None, tool_parser)
        added = tok.get_added_vocab() if tok is not None else {}
        self.tool_specials = frozenset(m for m in (self.tool_format.open_marker, self.tool_format.close_marker,
                                                   self.tool_format.prefix) if m and m in added)
        if reasoning_parser not in (reasoning_parsers.AUTO, reasoning_parsers.NONE, *reasoning_parsers.FORMATS):
            raise InputError(f"reasoning parser {reasoning_parser!r}: expected {reasoning_parsers.AUTO}, "
                             f"{reasoning_parsers.NONE} or one of {', '.join(reasoning_parsers.FORMATS)}")
        # the template's reasoning section (None: none, or --reasoning-parser none) and which of its markers are tokens
        self.reasoning = reasoning_parsers.detect(tok.chat_template if tok is not None else None, reasoning_parser)
        self.reasoning_specials = frozenset(m for m in (self.reasoning.open, self.reasoning.close)
                                            if m in added) if self.reasoning is not None else frozenset()
        self.methods = [AUTO] + [m for m in METHODS if m in MODEL_FREE or gen.has(m)]
        if method not in self.methods:
            raise InputError(f"method {method!r}: {gen.directory} serves {', '.join(self.methods)}")
        if max_batch < 1:
            raise InputError(f"max batch {max_batch}: must be at least 1")
        self.method = method
        greedy = gen.method_for(method, greedy=True)[0]   # what the default runs for greedy requests
        if gen.has(greedy):   # its drafter now (its load errors too), the others at first use
            getattr(gen, greedy)
        self.max_len = gen.max_len
        # the most characters a prompt that fits can have: every token covers at most the longest token's
        self.token_chars = max(map(len, gen.tokenizer.get_vocab())) if gen.tokenizer is not None else None
        self.token_texts = TokenTexts(gen.tokenizer)   # logprobs' token texts and bytes
        self.tokenizing = ThreadPoolExecutor(1, thread_name_prefix="specrt-tokenize")
        self.compiling = ThreadPoolExecutor(1, thread_name_prefix="specrt-grammar")   # grammar(): see compiled()
        self.metrics = Metrics(model_name, lambda: len(self.scheduler.waiting), lambda: self.gen.prefix_cache,
                               lambda: self.gen.suffix_cache, lambda: self.scheduler.kv_usage())
        self.scheduler = Scheduler(gen, max_batch, measure=greedy != "autoregressive", metrics=self.metrics,
                                   max_waiting=max_waiting, timeout=request_timeout)

    async def call(self, fn: Callable, *args):
        """fn(*args) on the tokenizing thread (tokenizers are not shared between threads)."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizing, fn, *args)

    def close(self) -> None:
        self.scheduler.close()
        self.tokenizing.shutdown(wait=False, cancel_futures=True)
        self.compiling.shutdown(wait=False, cancel_futures=True)

    # ---- requests --------------------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist: this server serves {self.model_name!r}", "model",
                           "model_not_found")

    def check_chars(self, chars: int, param: str) -> None:
        """A text that cannot fit the model's sequence length even in the tokenizer's longest tokens is refused
        before it is tokenized (the one tokenizer thread is not held up by a huge prompt)."""
        if self.token_chars is not None and chars > self.max_len * self.token_chars:
            raise APIError(400, f"{param}: {chars} characters do not fit the model's maximum sequence length "
                                f"{self.max_len} (at most {self.max_len * self.token_chars} characters: "
                                f"{self.token_chars} a token at the most): shorten it", param,
                           "context_length_exceeded")

    def completion_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.gen.tokenizer is None:
                raise APIError(400, f"prompt: {self.model_name} has no tokenizer: send the prompt as a list of "
                                    "token ids", "prompt")
            return self.gen.encode(prompt, chat=False)
        vocab = self.gen.target.spec["vocab_size"]
        bad = [i for i in prompt if not 0 <= i < vocab]
        if not prompt or bad:
            raise APIError(400, f"prompt: token ids {bad[:5] or prompt}: need at least one id, each in [0, {vocab})",
                           "prompt")
        return prompt

    def chat_ids(self, messages: list[Message], tools: list[dict] | None = None,
                 template_kwargs: dict | None = None) -> list[int]:
        """The prompt's ids, through the model's chat template; `tools` (OpenAI's tool objects) go to a template
        that takes them (it mentions `tools`), else into a system message (TOOLS_PROMPT): the first, or a new one;
        `template_kwargs` (the request's chat_template_kwargs, checked by the schema) are the template's variables."""
        tok = self.gen.tokenizer
        if tok is None or not tok.chat_template:
            raise APIError(400, f"messages: {self.model_name} has no chat template: use /v1/completions with the "
                                "prompt as text or token ids", "messages")
        native = "tools" in tok.chat_template
        turns = [_turn(m, native, self.tool_format) for m in messages]
        if tools and not native:
            prompt = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t["function"]) for t in tools),
                                         call=self.tool_format.instruction())
            if turns[0]["role"] == "system":
                turns[0]["content"] = f"{turns[0]['content'] or ''}\n\n{prompt}"
            else:
                turns.insert(0, {"role": "system", "content": prompt})
        extra = (template_kwargs or {}) | ({"tools": tools} if tools and native else {})
        try:
            ids = tok.apply_chat_template(turns, add_generation_prompt=True, tokenize=True, **extra)
        except jinja2.TemplateError as e:
            raise APIError(400, f"messages: the model's chat template refused them: {e}", "messages") from e
        except (TypeError, ValueError) as e:   # a variable of a type the template cannot use
            if not template_kwargs:
                raise
            raise APIError(400, f"chat_template_kwargs: the model's chat template failed with them ({e}): give it "
                                "the variables it reads, of the types it reads", "chat_template_kwargs") from e
        return list(ids if isinstance(ids, list) else ids["input_ids"])

    def thinking(self, ids: list[int]) -> Thinking | None:
        """A chat prompt's reasoning (None: the template has no reasoning section): whether the prompt has opened
        the section, read from its last tokens (on the tokenizing thread)."""
        if self.reasoning is None:
            return None
        tail = self.gen.tokenizer.decode(ids[-32:])
        return Thinking.of_prompt(self.reasoning, tail, self.reasoning_specials)

    def tools(self, req: ChatRequest) -> Tools | None:
        """The request's tools (tool_use), their calls in this server's format."""
        return tool_use(req, self.tool_format, self.tool_specials)

    def asked_grammar(self, req: BaseRequest, tools: Tools | None = None) -> tuple[str, str, object] | None:
        """The grammar the request's output follows, as (its field, kind, spec), None for free text: its
        response_format, guided_regex, guided_grammar or forced tool call, one at most. With tools and
        tool_choice auto, the tools' grammar (free text, or calls once the model opens one) where no other is
        asked for; with another, the calls are read from the reply as it comes, unconstrained."""
        fmt, asked = req.response_format, []
        if fmt is not None and (fmt.type == "json_schema") != (fmt.json_schema is not None):
            raise APIError(400, f"response_format: type {fmt.type!r} " + ("needs json_schema" if fmt.json_schema
                                is None else "takes no json_schema"), "response_format")
        if fmt is not None and fmt.type != "text":
            asked.append(("response_format", fmt.type, fmt.json_schema and fmt.json_schema.schema_))
        if req.guided_regex is not None:
            asked.append(("guided_regex", "regex", req.guided_regex))
        if req.guided_grammar is not None:
            asked.append(("guided_grammar", "grammar", req.guided_grammar))
        if tools is not None and (tools.forced or not asked):
            asked.append(("tools", "grammar", tools.grammar))
        if len(asked) > 1:
            names = [name if name != "tools" else "tool_choice" for name, *_ in asked]
            raise APIError(400, f"{names[1]}: the output follows one of {' and '.join(names)}, not both", names[1])
        return asked[0] if asked else None

    async def compiled(self, req: BaseRequest, tools: Tools | None = None,
                       thinking: Thinking | None = None) -> Grammar | None:
        """The request's grammar (asked_grammar) compiled, or from the cache, on the thread that compiles grammars,
        one at a time, never on the tokenizing thread that every request needs: one that takes seconds (10 at most)
        holds up only the grammars behind it. A spec that does not compile is a 400 naming its field, as is one
        past the server's bounds (grammar.Limits), compiled first in a child process (grammar.Sandbox) so that one
        that crashes the compiler or runs away costs that process only. With `thinking` (a reasoning template), the
        grammar applies from the end of the reasoning (Thinking.grammar), which is free."""
        asked = self.asked_grammar(req, tools)
        if asked is None:
            return None
        param, kind, spec = asked
        try:
            if thinking is not None:
                kind, spec = "grammar", thinking.grammar(kind, spec)
            if self.gen.tokenizer is not None:   # its llguidance twin: made once, on the tokenizer's own thread
                await self.call(grammar_library, self.gen.tokenizer)
            return await asyncio.get_running_loop().run_in_executor(
                self.compiling, partial(self.gen.grammar, kind, spec, isolated=True))
        except InputError as e:
            raise APIError(400, f"{param}: {e}", param) from e

    def options(self, req: BaseRequest, ids: list[int], param: str, max_tokens: int | None,
                grammar: Grammar | None = None, tenant: str | None = None) -> dict:
        """generate()'s keyword arguments for a request whose prompt is `ids`, and its stop_token_ids. What the
        schema cannot say is checked here, each a 400 that names its field. `tenant`: the name of the API key it
        came with (None: the server has none); with its cache_salt, the prefix cache's partition it reads and adds
        to (docs/serving.md)."""
        if not ids:
            raise APIError(400, f"{param}: empty: it gives no token to start from; send some text", param)
        if len(ids) >= self.max_len:
            raise APIError(400, f"{param}: {len(ids)} tokens do not fit the model's maximum sequence length "
                                f"{self.max_len} (with room for one new token): shorten it", param,
                           "context_length_exceeded")
        method = req.specrt.method or self.method
        if method not in self.methods:
            raise APIError(400, f"specrt.method {method!r}: {self.model_name} serves {', '.join(self.methods)}",
                           "specrt.method")
        if req.n > 1 and req.specrt.rounds:
            raise APIError(400, f"n {req.n}: specrt.rounds reports the rounds of one sequence; ask for n=1",
                           "specrt.rounds")
        if req.n > 1 and req.stream:
            raise APIError(400, f"n {req.n}: a stream gives one choice; ask for n=1 or stream=false", "n")
        if req.n > self.scheduler.capacity:
            raise APIError(400, f"n {req.n}: this server decodes at most {self.scheduler.capacity} sequences at once "
                                f"(--max-batch {self.scheduler.capacity}): ask for n <= {self.scheduler.capacity} in "
                                "each request, or serve with a larger --max-batch", "n")
        temperature = 1.0 if req.temperature is None else req.temperature
        try:
            SamplingParams(temperature)   # what the schema cannot say: too small to divide by
        except InputError as e:
            raise APIError(400, str(e), "temperature") from e
        top_k = max(req.top_k or 0, 0)   # vLLM's -1 is off, as 0 is
        if top_k and req.specrt.top_k and top_k != req.specrt.top_k:
            raise APIError(400, f"top_k {req.top_k} and specrt.top_k {req.specrt.top_k}: give one of them", "top_k")
        return dict(max_new_tokens=max_tokens or self.max_len - len(ids), temperature=temperature,
                    top_p=1.0 if req.top_p is None else req.top_p, top_k=top_k or req.specrt.top_k, seed=req.seed,
                    min_p=req.min_p or 0.0, method=method, gamma=req.specrt.gamma, tree=req.specrt.tree,
                    adaptive=req.specrt.adaptive, acceptance=req.specrt.acceptance, rounds=req.specrt.rounds,
                    logprobs=self.logprobs(req),
                    penalties=self.penalties(req), grammar=grammar,
                    cache_partition=None if tenant is None and req.cache_salt is None else
                    json.dumps([tenant, req.cache_salt]),
                    stop_token_ids=frozenset(self.token_ids(req.stop_token_ids or [], "stop_token_ids")))

    def logprobs(self, req: BaseRequest) -> int | None:
        """How many alternatives each token's logprobs carry (None: no logprobs): the chat's top_logprobs when
        logprobs is true, the completions' logprobs."""
        if not isinstance(req, ChatRequest):
            if req.best_of not in (None, req.n):
                raise APIError(400, f"best_of {req.best_of}: only equal to n ({req.n}) is served (each of n "
                                    "sequences is answered); ask for n", "best_of", "unsupported_value")
            return req.logprobs
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, f"top_logprobs {req.top_logprobs}: needs logprobs: true", "top_logprobs")
        return (req.top_logprobs or 0) if req.logprobs else None

    def penalties(self, req: BaseRequest) -> Penalties | None:
        """The request's processors of the target's logits (None: none)."""
        bias = req.logit_bias or {}
        tokens = self.token_ids([int(t) for t in bias], "logit_bias")
        same = {}
        for key, token in zip(bias, tokens):
            if (other := same.setdefault(token, key)) != key:   # "5" and "05": one id, two biases
                raise APIError(400, f"logit_bias: the keys {other!r} and {key!r} are both token id {token}: give "
                                    "each token once, as its id without leading zeros", "logit_bias")
        penalties = Penalties(req.presence_penalty or 0.0, req.frequency_penalty or 0.0,
                              1.0 if req.repetition_penalty is None else req.repetition_penalty,
                              tuple(sorted(zip(tokens, bias.values()))))
        return penalties if penalties.active else None

    def token_ids(self, ids: list[int], param: str) -> list[int]:
        vocab = self.gen.target.spec["vocab_size"]
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise APIError(400, f"{param}: token ids {bad[:5]}: each must be in [0, {vocab})", param)
        return ids

    # ---- generation ------------------------------------------------------------------------------------------
    async def events(self, ids: list[int], options: dict, copies: int) -> AsyncIterator[tuple]:
        """The scheduler's events for one request, until all its sequences have ended. Leaving early (client gone,
        stop string) frees its rows at the next round."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def put(item):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, item)
            except RuntimeError:   # the event loop has closed: nobody is listening
                pass

        job = Job(ids, options, copies, put)
        self.scheduler.submit(job)
        ended = 0
        try:
            while ended < copies:
                event = await queue.get()
                if isinstance(event, Exception):
                    raise api_error(event)   # the scheduler has logged where it came from
                ended += event[0] == "end"
                yield event
        finally:
            job.gone.set()

    def method_run(self, options: dict) -> str:
        """The method a request runs (`auto` resolved as its batch resolves it)."""
        return self.gen.method_for(options["method"], greedy=options["temperature"] == 0)[0]

    async def pieces(self, ids: list[int], options: dict, stops: list[str]) -> AsyncIterator[Piece]:
        """One sequence as the rounds produce it. Its finish reason is counted (abort: left before its end)."""
        text, events, end = StopText(stops), self.events(ids, options, 1), "abort"
        try:
            async for kind, _, *rest in events:
                if kind == "tokens":
                    new_ids, new, logprobs, rounds = rest
                    new, stopped = text.feed(new or "")
                    end = "stop" if stopped else end
                    yield Piece(new, new_ids, logprobs, "stop" if stopped else None, rounds=rounds)
                    if stopped:
                        return
                else:
                    reason, tail, stats = rest
                    new, stopped = text.feed(tail or "")
                    end = "stop" if stopped else _finish(reason)
                    yield Piece(new if stopped else new + text.flush(), [], None, end, stats)
                    return
        except Exception as e:
            end = "error" if api_error(e).status >= 500 else None   # a refused request (400, 429) never ran
            raise
        finally:
            if end is not None:
                self.metrics.finish(self.method_run(options), end)
            await events.aclose()

    def logprobs_format(self, chat: bool) -> Callable[[list], dict]:
        """A sequence's logprobs in its answer's shape, piece by piece (the legacy completions' `text_offset` runs
        on over the pieces)."""
        if chat:
            return lambda logprobs: chat_logprobs(self.token_texts, logprobs)
        return CompletionLogprobs(self.token_texts).piece

    async def answer(self, req: BaseRequest, ids: list[int], options: dict, chat: bool, tools: Tools | None = None,
                     thinking: Thinking | None = None):
        stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
        head = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                "model": self.model_name}
        want = options["logprobs"] is not None
        if req.n > 1:
            texts, tokens, lps, ends = [[] for _ in range(req.n)], [[] for _ in range(req.n)], \
                [[] for _ in range(req.n)], {}
            async for kind, i, *rest in self.events(ids, options, req.n):
                if kind == "tokens":
                    tokens[i] += rest[0]
                    texts[i].append(rest[1] or "")
                    lps[i] += rest[2] or []
                else:
                    texts[i].append(rest[1] or "")
                    ends[i] = (rest[0], rest[2])
            choices = []
            for i in range(req.n):
                text = StopText(stops)
                cut, stopped = text.feed("".join(texts[i]))
                reason = "stop" if stopped else _finish(ends[i][0])
                self.metrics.finish(ends[i][1]["method"], reason)
                logprobs = self.logprobs_format(chat)(lps[i]) if want else None
                cut, calls, thought = cut if stopped else cut + text.flush(), None, None
                if thinking is not None:
                    thought, cut = thinking.split(cut)
                if tools is not None:
                    cut, calls, reason = tool_answer(tools, cut, reason)
                choices.append(_choice(chat, i, cut, tokens[i], reason, logprobs, calls=calls,
                                       reasoning=thought if thinking is not None else False))
            return {**head, "object": "chat.completion" if chat else "text_completion", "choices": choices,
                    "usage": _usage(ids, sum(map(len, tokens)), ends[0][1]),
                    "specrt": {key: ends[0][1][key] for key in ("method", "acceptance", "distribution_preserving")}
                    | {"choices": [ends[i][1] for i in range(req.n)]}}
        pieces = self.pieces(ids, options, stops)
        first = await anext(pieces)    # the prefill's: errors are answered before the stream starts
        fmt = self.logprobs_format(chat) if want else None
        if req.stream:
            if thinking is not None:
                pieces = _with_reasoning(_chained(first, pieces), thinking)
                first = await anext(pieces)
            if tools is not None:
                pieces = _with_calls(_chained(first, pieces), tools)
                first = await anext(pieces)
            usage = req.stream_options is not None and req.stream_options.include_usage
            return StreamingResponse(_events(first, pieces, head, chat, ids, usage, fmt),
                                     media_type="text/event-stream")
        got = [first]
        if first.reason is None:
            got += [piece async for piece in pieces]
        tokens = [t for piece in got for t in piece.ids]
        logprobs = None
        if fmt is not None:
            logprobs = fmt([lp for piece in got for lp in piece.logprobs or []])
        text, reason, calls, thought = "".join(piece.text or "" for piece in got), got[-1].reason, None, None
        if thinking is not None:
            thought, text = thinking.split(text)
        if tools is not None:
            text, calls, reason = tool_answer(tools, text, reason)
        choice = _choice(chat, 0, text, tokens, reason, logprobs, calls=calls,
                         reasoning=thought if thinking is not None else False)
        stats = got[-1].stats
        if options["rounds"]:
            stats = {**(stats or {}), "round_log": _joined(piece.rounds for piece in got)}
        return {**head, "object": "chat.completion" if chat else "text_completion", "choices": [choice],
                "usage": _usage(ids, len(tokens), got[-1].stats), "specrt": stats}


def _choice(chat: bool, index: int, text: str | None, token_ids: list[int], reason: str | None,
            logprobs: dict | None = None, delta: bool = False, calls: list[dict] | None = None,
            reasoning: str | None | bool = False) -> dict:
    """One choice of an answer or a chunk; `reasoning` (a reasoning template's: None where the reply has none;
    False: no reasoning template) is the message's `reasoning_content`, or a delta's where it is a string."""
    if not chat:
        body = {"text": text or ""}
    elif delta and calls:   # tool_calls deltas (each with its index: CallReader)
        body = {"delta": {"tool_calls": calls}}
    elif delta and isinstance(reasoning, str):
        body = {"delta": {"reasoning_content": reasoning}}
    elif delta:
        body = {"delta": {"content": text} if text is not None else {}}
    elif calls:
        body = {"message": {"role": "assistant", "content": text, "tool_calls": calls}}
    else:
        body = {"message": {"role": "assistant", "content": text or ""}}
    if not delta and chat and reasoning is not False:
        body["message"]["reasoning_content"] = reasoning
    return {"index": index, **body, "logprobs": logprobs, "finish_reason": reason, "token_ids": token_ids}


def _usage(ids: list[int], completion: int, stats: dict | None = None) -> dict:
    """OpenAI's usage, with the prompt tokens that came from the prefix cache as its `cached_tokens`."""
    usage = {"prompt_tokens": len(ids), "completion_tokens": completion, "total_tokens": len(ids) + completion}
    cached = (stats or {}).get("prefix_cache_tokens")
    return usage | ({"prompt_tokens_details": {"cached_tokens": cached}} if cached is not None else {})


async def _events(first: Piece, pieces: AsyncIterator[Piece], head: dict, chat: bool, ids: list[int],
                  include_usage: bool, logprobs: Callable[[list], dict] | None) -> AsyncIterator[str]:
    """Server-sent events in OpenAI's chunk format: the pieces (each with its tokens' logprobs when asked), a last
    chunk with the finish reason, the usage chunk when asked, then [DONE]."""
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    def event(choices: list, usage: dict | None = None, specrt: dict | None = None) -> str:
        body = {**head, "choices": choices, **({"usage": usage} if include_usage else {}),
                **({"specrt": specrt} if specrt else {})}   # {"rounds": [...]}, or the last chunk's figures
        return f"data: {json.dumps(body)}\n\n"

    if chat:
        yield event([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                      "finish_reason": None, "token_ids": []}])
    count, stats = 0, None
    try:
        piece = first
        while True:
            count += len(piece.ids)
            lps = logprobs(piece.logprobs or []) if logprobs is not None and piece.ids else None
            rounds = {"rounds": piece.rounds} if piece.rounds is not None else None
            sent = False   # the piece's tokens have come with a chunk
            if piece.reasoning:   # its reasoning (a reasoning template's), its tokens with it
                yield event([_choice(chat, 0, None, piece.ids, None, lps, delta=True, reasoning=piece.reasoning)],
                            specrt=rounds)
                lps = rounds = None
                sent = True
            if piece.text or piece.ids and not piece.calls and not sent:   # its content (the tokens with it)
                yield event([_choice(chat, 0, piece.text, [] if sent else piece.ids, None, lps, delta=True)],
                            specrt=rounds)
                lps = rounds = None
                sent = True
            for k, call in enumerate(piece.calls or []):   # each call delta a chunk, as OpenAI sends them
                call_ids = piece.ids if k == 0 and not sent else []
                yield event([_choice(chat, 0, None, call_ids, None, lps, delta=True, calls=[call])], specrt=rounds)
                lps = rounds = None
            if piece.reason is not None:   # the last chunk carries the request's figures (a stop string's: none)
                stats = piece.stats
                yield event([_choice(chat, 0, None if chat else "", [], piece.reason, delta=True)], specrt=stats)
                break
            piece = await anext(pieces)
        if include_usage:
            yield event([], _usage(ids, count, stats))
    except Exception as e:   # noqa: BLE001 -- any error ends the stream with an error chunk, then [DONE]
        e = api_error(e)
        yield f"data: {json.dumps(error_body(e.message, e.param, e.code, e.status))}\n\n"
    finally:
        await pieces.aclose()
    yield "data: [DONE]\n\n"
