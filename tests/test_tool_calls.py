"""Tool calls through the openai client against a real `specrt serve`, one server per format of serving.tool_parsers
(hermes, llama3_json, json), each a chat template of our own on one tiny random model with its own tokenizer: a
call with tool_choice auto (after free text) and a plain answer, required, a named function, two calls in one
answer; streamed and not. A tiny model's output is random: logit_bias (with a frequency penalty, which lowers a
token each time the output holds it) steers it, and the tests check what the steering cannot decide (the grammar
holding each call to its tool's schema, the stream's deltas)."""
from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
import torch

from conftest import tiny_config
from specrt.engines.manifest import sha256_file
from test_serve import client, running_server

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now.",
                                           "parameters": {"type": "object", "properties": {
                                               "city": {"enum": ["Paris", "Tokyo", "Lima"]},
                                               "unit": {"enum": ["celsius", "fahrenheit"]}},
                                               "required": ["city", "unit"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "get_time", "description": "The time in a time zone.",
                                           "parameters": {"type": "object", "properties": {
                                               "offset": {"type": "integer", "minimum": -12, "maximum": 14}},
                                               "required": ["offset"], "additionalProperties": False}}}]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MAX_LEN = 1024
ASK = [{"role": "user", "content": "What is the weather in Paris, and the time in Tokyo?"}]

# the three templates: ChatML turns; hermes and llama3_json take the tools as Qwen2.5's and Llama 3.1's do
HERMES = (
    "{% if tools %}<|im_start|>system\nYou may call functions. <tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
    "</tools> For each call write <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] %}{{ m['content'] }}"
    "{% endif %}{% for c in m.get('tool_calls') or [] %}<tool_call>\n{{ c['function'] | tojson }}\n</tool_call>"
    "{% endfor %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if loop.last and tools %}Given these functions, answer "
    "with a JSON {\"name\": function name, \"parameters\": its arguments}.{% for t in tools %}{{ t | tojson }}"
    "{% endfor %}\n{% endif %}{% if m['content'] %}{{ m['content'] }}{% endif %}{% for c in m.get('tool_calls') "
    "or [] %}<|python_tag|>{\"name\": \"{{ c['function']['name'] }}\", \"parameters\": {{ c['function']"
    "['arguments'] | tojson }}}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEMPLATES = {"hermes": HERMES, "llama3_json": LLAMA, "json": CHATML}


@pytest.fixture(scope="module")
def tiny_chat(tmp_path_factory):
    """A one-layer random Llama over a 384-id BPE with ChatML tokens, `<tool_call>` and `</tool_call>` (added tokens
    that are text, as Qwen's are) and `<|python_tag|>` (a special token, as Llama's is), exported and built once;
    then an engine set per template, the same engines with that chat template. Returns ({format: directory},
    tokenizer)."""
    import transformers

    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    from test_train import tiny_tokenizer

    tmp = tmp_path_factory.mktemp("tool-calls")
    tok = tiny_tokenizer(384)
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.add_special_tokens({"additional_special_tokens": ["<|python_tag|>"]})
    config = tiny_config("llama", vocab=len(tok), layers=1)
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.max_position_embeddings = MAX_LEN   # the tools in the prompt take ~500 of these tokens
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp / "src")
    tok.chat_template = CHATML
    tok.save_pretrained(tmp / "src")
    export_engines(str(tmp / "src"), tmp / "json", max_seq_len=MAX_LEN, log=lambda *_: None)
    build(tmp / "json", "onnxruntime", log=lambda *_: None)
    sets = {"json": tmp / "json"}
    for name in ("hermes", "llama3_json"):
        sets[name] = tmp / name
        shutil.copytree(tmp / "json", sets[name])
        (sets[name] / "tokenizer" / "chat_template.jinja").write_text(TEMPLATES[name])
        manifest = json.loads((sets[name] / "manifest.json").read_text())
        for entry in manifest["tokenizer"]:
            entry["sha256"] = sha256_file(sets[name] / entry["file"])
        (sets[name] / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return sets, tok


@pytest.fixture(scope="module", params=["hermes", "llama3_json", "json"])
def served(request, tiny_chat, tmp_path_factory):
    """`specrt serve` of one format's engine set (the format found from its chat template): (format, client,
    steering), where steering gives the token ids the tests bias: `open`, the token that opens a call (hermes'
    <tool_call>, Llama's <|python_tag|>, json's "{"), `eos`, `close` (what ends the calls: json's "]", else the end
    of sequence) and `word`, a token of plain text, with its text."""
    sets, tok = tiny_chat
    fmt = request.param
    log = tmp_path_factory.mktemp(f"serve-{fmt}") / "server.log"
    with running_server(sets[fmt], log, "--threads", "1", "--model-name", "tiny") as (url, _):
        ids = {"hermes": "<tool_call>", "llama3_json": "<|python_tag|>", "json": "{"}
        word = tok.encode("Sure")[0]
        eos = tok.convert_tokens_to_ids("<|im_end|>")
        steer = {"open": tok.convert_tokens_to_ids(ids[fmt]), "eos": eos,
                 "close": tok.convert_tokens_to_ids("]") if fmt == "json" else eos,   # json's array ends with "]"
                 "word": word, "word_text": tok.decode([word]), "tok": tok}
        yield fmt, client(url), steer


def bias(**pairs) -> dict:
    return {str(token): value for token, value in pairs.values()}


def ask(api, stream: bool = False, **kw):
    """A chat request with the tools, greedy; the answer as (content, calls [{id, name, arguments}], finish reason,
    the number of argument deltas each call came in (streamed; None: not streamed))."""
    body = dict(model="tiny", messages=ASK, tools=TOOLS, temperature=0, max_tokens=96, **kw)
    if not stream:
        choice = api.chat.completions.create(**body).choices[0]
        calls = [{"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}
                 for c in choice.message.tool_calls or []]
        return choice.message.content, calls, choice.finish_reason, None
    content, calls, reason, pieces = None, [], None, []
    for chunk in api.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta if chunk.choices else None
        reason = chunk.choices[0].finish_reason or reason if chunk.choices else reason
        if delta is None:
            continue
        if delta.content:
            content = (content or "") + delta.content
        for d in delta.tool_calls or []:
            if d.index == len(calls):   # a call's first delta: its id, type and name, no arguments yet
                assert d.id and d.type == "function" and d.function.name and d.function.arguments == "", d
                calls.append({"id": d.id, "type": d.type, "name": d.function.name, "arguments": ""})
                pieces.append(0)
            else:                       # then its arguments, piece by piece
                assert d.index == len(calls) - 1 and d.id is None and d.function.name is None, d
                calls[d.index]["arguments"] += d.function.arguments
                pieces[d.index] += 1
    return content, calls, reason, pieces


def check_calls(calls: list[dict], names=None) -> None:
    """Each call is one of the tools (of `names`), its arguments valid against that tool's parameters."""
    for call in calls:
        assert call["id"].startswith("call_") and call["type"] == "function", call
        assert call["name"] in (names or SCHEMAS), call
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def same_answer(api, **kw):
    """The request answered whole and streamed: the same content, calls (names and arguments; each call's id its
    own) and finish reason; the streamed arguments came in pieces as they were generated (more argument deltas
    than calls). Returns the whole answer."""
    content, calls, reason, _ = whole = ask(api, **kw)
    s_content, s_calls, s_reason, pieces = ask(api, stream=True, **kw)
    assert (s_content, s_reason) == (content, reason), (whole, s_content, s_reason)
    assert [(c["name"], c["arguments"]) for c in s_calls] == [(c["name"], c["arguments"]) for c in calls], s_calls
    assert sum(pieces) > len(pieces), f"each call's arguments in one piece, not as they were generated: {pieces}"
    return whole


def test_auto_calls_once_opened_and_answers_text_otherwise(served):
    """tool_choice auto: with the call's opening favoured (after a word of text for hermes, whose calls may follow
    text), the answer is a call, held to its tool's schema, finish_reason tool_calls; with a word and the end
    favoured instead, a plain answer. Streamed and not, the same."""
    fmt, api, t = served
    lead = {"word": (t["word"], 11)} if fmt == "hermes" else {}
    content, calls, reason, _ = same_answer(api, parallel_tool_calls=False, frequency_penalty=2, extra_body={
        "logit_bias": bias(**lead, open=(t["open"], 10), eos=(t["eos"], 4))})
    assert (reason, len(calls)) == ("tool_calls", 1), (content, calls, reason)
    assert content == (t["word_text"] if fmt == "hermes" else None), content
    check_calls(calls)
    content, calls, reason, _ = ask(api, frequency_penalty=2, extra_body={
        "logit_bias": bias(word=(t["word"], 5), eos=(t["eos"], 4))})
    assert (content, calls, reason) == (t["word_text"], [], "stop")


def test_required_and_named_function(served):
    """tool_choice required: calls of the tools and nothing else; a named function: calls of it; streamed and not.
    (The model's own choices: which tool, how many calls.)"""
    fmt, api, t = served
    end = {"logit_bias": bias(eos=(t["eos"], 5), close=(t["close"], 5))}   # after a call, the end, not another
    content, calls, reason, _ = same_answer(api, tool_choice="required", extra_body=end)
    assert (content, reason) == (None, "tool_calls") and calls, (content, calls)
    check_calls(calls)
    named = {"type": "function", "function": {"name": "get_time"}}
    content, calls, reason, _ = same_answer(api, tool_choice=named, parallel_tool_calls=False)
    assert (content, reason, len(calls)) == (None, "tool_calls", 1), (content, calls)
    check_calls(calls, ["get_time"])


def test_two_calls_in_one_answer(served):
    """Two calls in one answer (parallel_tool_calls, the default), each held to its tool's schema, streamed and not.
    The steering: the token that begins another call (hermes' <tool_call>, Llama's ";" of "; ", json's "," in its
    array) favoured over the end, less so each time the output holds it (frequency_penalty), so that the end wins
    after the second call."""
    fmt, api, t = served
    tok = t["tok"]
    again = {"hermes": (t["open"], 7), "llama3_json": (tok.convert_tokens_to_ids(";"), 4),
             "json": (tok.convert_tokens_to_ids(","), 4)}[fmt]   # (inside a call, json's commas are '",' tokens)
    steer = {"again": again, "close": (t["close"], 4 if fmt == "hermes" else 3)}
    if fmt != "hermes":
        steer["open"] = (t["open"] if fmt == "llama3_json" else tok.convert_tokens_to_ids("["), 10)
    content, calls, reason, _ = same_answer(api, frequency_penalty=2, extra_body={"logit_bias": bias(**steer)})
    assert (content, reason, len(calls)) == (None, "tool_calls", 2), (content, calls)
    check_calls(calls)
    assert len({c["id"] for c in calls}) == 2


READS = {   # format: (reply, its content, its calls as (name, arguments))
    "hermes": ('Sure.<tool_call>\n{"name": "get_time", "arguments": {"offset": -3}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}}\n</tool_call>', "Sure.",
               [("get_time", '{"offset": -3}'), ("get_weather", '{"city": "Lima", "unit": "celsius"}')]),
    "llama3_json": ('{"name": "get_time", "parameters": {"offset": 2}}; {"name": "get_time", "parameters": '
                    '{"offset": 14}}', None, [("get_time", '{"offset": 2}'), ("get_time", '{"offset": 14}')]),
    "json": ('[{"name": "get_weather", "arguments": {"city": "Paris", "unit": "fahrenheit"}}, {"arguments": '
             '{"offset": 0}, "name": "get_time"}]', None,
             [("get_weather", '{"city": "Paris", "unit": "fahrenheit"}'), ("get_time", '{"offset": 0}')]),
}


@pytest.mark.parametrize("fmt", sorted(READS))
def test_the_reader_gives_the_same_calls_however_the_text_comes(fmt):
    """serving.tool_parsers.CallReader: a reply fed at once, a character at a time or in random pieces gives the
    same content and calls, and the deltas joined are the calls (a name after the arguments, possible only where no
    grammar held the reply, comes whole at the object's end); a reply that is not calls is content, all of it."""
    import random

    from specrt.serving.tool_parsers import FORMATS, CallReader

    text, content, want = READS[fmt]
    rng = random.Random(0)
    at = [0, *sorted(rng.sample(range(1, len(text)), 12)), len(text)]
    cuts = [[text], list(text), [text[i:j] for i, j in zip(at, at[1:])]]
    for pieces in cuts:
        reader = CallReader(FORMATS[fmt], frozenset(SCHEMAS))
        said, joined = "", {}
        for piece in pieces:
            new, deltas = reader.feed(piece)
            said += new
            for d in deltas:
                got = joined.setdefault(d["index"], {"name": d["function"].get("name"), "arguments": ""})
                got["arguments"] += d["function"]["arguments"]
        said += reader.end()
        assert (said or None) == content and [(c["function"]["name"], c["function"]["arguments"])
                                              for c in reader.calls] == want, (pieces, said, reader.calls)
        assert [(j["name"], j["arguments"]) for j in joined.values()] == want
    for other in ("no call here {", '{"name": "get_news", "arguments": {}}', "<tool_call> not json"):
        reader = CallReader(FORMATS[fmt], frozenset(SCHEMAS))
        assert reader.feed(other)[0] + reader.end() == other and not reader.calls, other
