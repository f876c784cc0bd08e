"""Reasoning through the openai client against a real `specrt serve`: a chat template of our own with a thinking
section (its generation prompt opens `<think>`, or, with `enable_thinking: false`, holds an empty one, as Qwen3's
does) on a tiny random model whose tokenizer has `<think>` and `</think>` as added tokens (as Qwen's are). The
reasoning comes as `reasoning_content` apart from `content`, streamed as its own deltas; chat_template_kwargs reach
the template; a JSON schema (and a forced tool call) applies after the reasoning, never inside it. A tiny model's
output is random: logit_bias with presence and frequency penalties (which lower a token once the output holds it)
steers it to a first word, the close marker, a second word, the end."""
from __future__ import annotations

import json
import random

import jsonschema
import openai
import pytest
import torch

from conftest import tiny_config
from test_serve import client, running_server
from test_tool_calls import TOOLS, bias, check_calls

TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")
ASK = [{"role": "user", "content": "Is Paris the capital of France?"}]
SCHEMA = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """`specrt serve` of a one-layer random Llama with the reasoning template (the reasoning parser found from it):
    (client, steering), steering the token ids the tests bias: `first` and `second`, words (with their texts),
    `close` (`</think>`), `eos`."""
    import transformers

    from specrt.export.build import build
    from specrt.export.pipeline import export_engines
    from test_train import tiny_tokenizer

    tmp = tmp_path_factory.mktemp("reasoning")
    tok = tiny_tokenizer(384)
    tok.add_tokens(["<think>", "</think>"])
    config = tiny_config("llama", vocab=len(tok), layers=1)
    config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    config.max_position_embeddings = 1024   # the tools in the prompt take ~500 of these tokens
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(tmp / "src")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(tmp / "src")
    export_engines(str(tmp / "src"), tmp / "engines", max_seq_len=1024, log=lambda *_: None)
    build(tmp / "engines", "onnxruntime", log=lambda *_: None)
    first, second = tok.encode("Sure")[0], tok.encode("Yes")[0]
    steer = {"first": first, "second": second, "first_text": tok.decode([first]), "second_text": tok.decode([second]),
             "close": tok.convert_tokens_to_ids("</think>"), "eos": config.eos_token_id}
    assert steer["first_text"] != steer["second_text"]
    with running_server(tmp / "engines", tmp / "server.log", "--threads", "1", "--model-name", "tiny") as (url, _):
        yield client(url), steer


def ask(api, stream: bool = False, **kw) -> tuple[str | None, str | None, str, list]:
    """A greedy chat request: (reasoning_content, content, finish reason, tool calls as (name, arguments)); streamed,
    the deltas joined (each delta is reasoning or content, never both)."""
    body = dict(model="tiny", messages=ASK, temperature=0, max_tokens=40, presence_penalty=2,
                frequency_penalty=2) | kw
    if not stream:
        choice = api.chat.completions.create(**body).choices[0]
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls or []]
        return choice.message.reasoning_content, choice.message.content, choice.finish_reason, calls
    reasoning = content = None
    reason, calls = None, []
    for chunk in api.chat.completions.create(**body, stream=True):
        delta = chunk.choices[0].delta
        reason = chunk.choices[0].finish_reason or reason
        thought = getattr(delta, "reasoning_content", None)
        assert not (thought and delta.content), delta
        if thought:
            reasoning = (reasoning or "") + thought
        if delta.content:
            content = (content or "") + delta.content
        for d in delta.tool_calls or []:
            if d.index == len(calls):
                calls.append([d.function.name, ""])
            calls[d.index][1] += d.function.arguments
    return reasoning, content, reason, [tuple(c) for c in calls]


def both(api, **kw):
    """The request answered whole and streamed: the same reasoning, content, finish reason and calls."""
    whole, streamed = ask(api, **kw), ask(api, stream=True, **kw)
    assert streamed[:3] == (whole[0], whole[1] or None, whole[2]) and streamed[3] == whole[3], (whole, streamed)
    return whole


def steering(t, **values) -> dict:
    return {"logit_bias": bias(**{name: (t[name], value) for name, value in values.items()})}


def test_reasoning_and_content_apart_streamed_and_not(served):
    """The prompt opens <think>: the first word is reasoning, the text after </think> content; streamed as
    reasoning_content deltas, then content deltas, joined the same as the whole answer."""
    api, t = served
    reasoning, content, reason, _ = both(api, extra_body=steering(t, first=13, close=12, second=11, eos=10))
    assert (reasoning, content, reason) == (t["first_text"], t["second_text"], "stop")


def test_enable_thinking_reaches_the_template(served):
    """chat_template_kwargs {"enable_thinking": false}: the template closes an empty section in the prompt, so the
    same steered reply is all content (its </think> is text), no reasoning. A value that is not a JSON scalar, or a
    name the template's own arguments have, is a 400 naming it."""
    api, t = served
    kw = steering(t, first=13, close=12, second=11, eos=10) | {"chat_template_kwargs": {"enable_thinking": False}}
    reasoning, content, reason, _ = both(api, extra_body=kw)
    assert (reasoning, content, reason) == (None, f"{t['first_text']}</think>{t['second_text']}", "stop")
    for bad, named in (({"enable_thinking": [1]}, "enable_thinking: a list"), ({"tools": "x"}, "tools: the server")):
        with pytest.raises(openai.BadRequestError) as e:
            ask(api, extra_body={"chat_template_kwargs": bad})
        assert e.value.body["param"] == "chat_template_kwargs" and named in e.value.body["message"], e.value.body


def test_schema_applies_after_free_reasoning(served):
    """response_format json_schema: the reasoning is free (a word the schema would refuse), the content after
    </think> valid against the schema; streamed and not."""
    api, t = served
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    reasoning, content, reason, _ = both(api, response_format=fmt, extra_body=steering(t, first=13, close=12))
    assert reasoning == t["first_text"] and reason == "stop", (reasoning, content)
    jsonschema.validate(json.loads(content), SCHEMA)


def test_forced_tool_call_after_the_reasoning(served):
    """tool_choice required: the reasoning free, then a call held to its tool's schema."""
    api, t = served
    reasoning, content, reason, calls = both(api, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                             max_tokens=64, extra_body=steering(t, first=13, close=12))
    assert (reasoning, content, reason, len(calls)) == (t["first_text"], None, "tool_calls", 1), calls
    check_calls([{"id": "call_", "type": "function", "name": name, "arguments": args} for name, args in calls])


@pytest.mark.parametrize("opened", [True, False])
def test_the_reader_splits_the_same_however_the_text_comes(opened):
    """serving.reasoning.ReasoningReader: a reply fed at once, a character at a time or in random pieces gives the
    same reasoning and content; a reply without the section is content, all of it. The format is found from a
    template that mentions <think> (--reasoning-parser auto), none for another or with --reasoning-parser none."""
    from specrt.serving.reasoning import FORMATS, Thinking, detect

    thinking = Thinking(FORMATS["qwen3"], opened)
    text = ("" if opened else "\n<think>") + "Let me see: </thin k> {no} </thi" + "</think>\n\n{\"answer\": \"yes\"}<"
    rng = random.Random(0)
    at = [0, *sorted(rng.sample(range(1, len(text)), 9)), len(text)]
    for pieces in ([text], list(text), [text[i:j] for i, j in zip(at, at[1:])]):
        reader, said = thinking.reader(), ["", ""]
        for piece in pieces + [None]:
            got = reader.feed(piece) if piece is not None else reader.end()
            said = [said[0] + got[0], said[1] + got[1]]
        assert said == ["Let me see: </thin k> {no} </thi", "\n\n{\"answer\": \"yes\"}<"], (pieces, said)
    assert thinking.split("Let me see") == (("Let me see", "") if opened else (None, "Let me see"))
    assert Thinking.of_prompt(FORMATS["qwen3"], "assistant\n<think>\n").opened
    assert (detect(TEMPLATE), detect(TEMPLATE, "none"), detect("{{ messages }}")) == (FORMATS["qwen3"], None, None)
    assert not Thinking.of_prompt(FORMATS["qwen3"], "assistant\n<think>\n\n</think>\n\n").opened
