"""Reasoning parsers (vLLM's reasoning parsers, DeepSeek's API): a reply's thinking section (Qwen3's, QwQ's and
DeepSeek-R1's `<think>…</think>`) taken out of its text as `reasoning_content`, the rest its `content`, whole or as
it streams (`ReasoningReader`); how a chat template is known to have one (`detect`: it mentions the open marker);
and the grammar of a reply whose answer follows a grammar (`Thinking.grammar`): free text up to and including the
close marker, then the answer's grammar, which never applies inside the reasoning.

A template may open the section in its generation prompt (`<|im_start|>assistant\\n<think>\\n`, as DeepSeek-R1's and
some of Qwen3's do): the reply then starts inside it (`Thinking.opened`, read from the prompt's last tokens). Else a
reply that begins with the open marker (after whitespace) reasons until the close marker, and any other is all
content (Qwen3 with `enable_thinking: false`, whose prompt holds an empty `<think>\\n\\n</think>` already).
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from specrt.decoding.grammar import JSON_LAYOUT
from specrt.errors import InputError

AUTO, NONE = "auto", "none"


@dataclass(frozen=True)
class ReasoningFormat:
    """How a template marks its reasoning: between `open` and `close`; `detect`, strings of a chat template that say
    it has such a section."""
    name: str
    open: str
    close: str
    detect: tuple[str, ...]


FORMATS = {f.name: f for f in (ReasoningFormat("qwen3", "<think>", "</think>", ("<think>",)),)}


def detect(chat_template: str | None, asked: str = AUTO) -> ReasoningFormat | None:
    """The reasoning format of a chat template (`asked`: a name of FORMATS, none, or auto: the first whose `detect`
    strings the template holds; None where it holds none)."""
    if asked == NONE:
        return None
    if asked != AUTO:
        return FORMATS[asked]
    template = chat_template or ""
    return next((f for f in FORMATS.values() if any(s in template for s in f.detect)), None)


class ReasoningReader:
    """A reply's text in, (reasoning, content) out, as it streams: the text after the open marker (or from the start,
    where the prompt opened the section) up to the close marker is reasoning, the rest content; a tail that could
    begin a marker is held back until it is known. The non-streamed answer is the same reader fed at once."""

    def __init__(self, fmt: ReasoningFormat, opened: bool):
        self.fmt = fmt
        self.state = "reasoning" if opened else "begin"   # begin, reasoning, content
        self.thought = opened    # the reply has a reasoning section
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        self.held += text
        reasoning = content = ""
        if self.state == "begin":   # whitespace, then the open marker, or content
            seen = self.held.lstrip()
            if seen.startswith(self.fmt.open):
                self.state, self.thought, self.held = "reasoning", True, seen[len(self.fmt.open):]
            elif not self.fmt.open.startswith(seen):
                self.state = "content"
            else:
                return "", ""
        if self.state == "reasoning":
            close = self.fmt.close
            at = self.held.find(close)
            if at < 0:
                keep = next((k for k in range(min(len(close) - 1, len(self.held)), 0, -1)
                             if close.startswith(self.held[-k:])), 0)
                reasoning, self.held = self.held[:len(self.held) - keep], self.held[len(self.held) - keep:]
                return reasoning, ""
            reasoning, self.held, self.state = self.held[:at], self.held[at + len(close):], "content"
        content, self.held = self.held, ""
        return reasoning, content

    def end(self) -> tuple[str, str]:
        """What was held back at the reply's end: a close marker's beginning is reasoning (a reply cut short while
        it reasons), an open marker's beginning content."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)


@dataclass(frozen=True)
class Thinking:
    """One chat request's reasoning: its format, whether its prompt opened the section (the reply starts inside it),
    and which of the markers are tokens of the tokenizer (`specials`: its added tokens)."""
    format: ReasoningFormat
    opened: bool
    specials: frozenset[str] = frozenset()

    @classmethod
    def of_prompt(cls, fmt: ReasoningFormat, prompt_tail: str, specials: frozenset[str] = frozenset()) -> Thinking:
        """`prompt_tail`: the end of the prompt's text (its generation prompt); the section is open where its last
        open marker comes after its last close marker."""
        return cls(fmt, prompt_tail.rfind(fmt.open) > prompt_tail.rfind(fmt.close), specials)

    def reader(self) -> ReasoningReader:
        return ReasoningReader(self.format, self.opened)

    def split(self, text: str) -> tuple[str | None, str]:
        """A whole reply as (its reasoning, None where it has no section; its content)."""
        reader = self.reader()
        reasoning, content = reader.feed(text)
        more, rest = reader.end()
        return (reasoning + more if reader.thought else None), content + rest

    def grammar(self, kind: str, spec) -> str:
        """The Lark grammar (llguidance's dialect) of a reply whose answer follows (kind, spec) (grammar.KINDS): the
        reasoning free up to and including the close marker (the whole section, optional, where the prompt has not
        opened it), a little whitespace, then the answer. A marker that is a token is that token, and the reasoning
        then cannot spell it as text; a marker that is text ends the reasoning where it first comes (a lazy
        lexeme)."""
        fmt, rules = self.format, []
        open_ = "" if self.opened else (f"{fmt.open} " if fmt.open in self.specials else f"{json.dumps(fmt.open)} ")
        if fmt.close in self.specials:
            rules += [f"REASONING: /(.|\\n)*/ & ~/(.|\\n)*{_rx(fmt.close)}(.|\\n)*/",
                      f"reasoning_section: {open_}REASONING {fmt.close}"]
        else:
            rules += ["REASONING: /(.|\\n)*/", f"reasoning_section[lazy]: {open_}REASONING {json.dumps(fmt.close)}"]
        answer = _answer(kind, spec, rules)
        rules += ["REASONING_GAP: /[ \\t\\r\\n]{0,4}/",
                  f"start: reasoning_section{'' if self.opened else '?'} REASONING_GAP {answer}"]
        return "\n".join(rules) + "\n"


def _answer(kind: str, spec, rules: list[str]) -> str:
    """The answer's part of the grammar: its symbol; a Lark grammar's rules go before `rules` (its `start` renamed)."""
    if kind in ("json_object", "json_schema"):
        schema = {"type": "object"} if kind == "json_object" else dict(spec)
        layout = schema.get("x-guidance")
        schema["x-guidance"] = JSON_LAYOUT | (layout if isinstance(layout, dict) else {})
        rules.append(f"reasoning_answer: %json {json.dumps(schema)}")
        return "reasoning_answer"
    if kind == "regex":
        rules.append(f"REASONING_ANSWER: /{_slashes(spec)}/")
        return "REASONING_ANSWER"
    from llguidance.gbnf_to_lark import any_to_lark   # GBNF as Lark (grammar_from's own conversion)
    try:
        lark = any_to_lark(spec)
    except Exception as e:   # noqa: BLE001 -- the converter's own errors, all of them a bad grammar
        raise InputError(f"grammar is not valid: {e}") from None
    rules[:0] = [_renamed(lark, "start", "reasoning_answer")]
    return "reasoning_answer"


def _rx(text: str) -> str:
    """`text` as a Lark regex literal's body that matches it."""
    return _slashes(re.escape(text))


def _slashes(regex: str) -> str:
    """A regex as the body of a Lark /regex/: its unescaped slashes escaped, its line breaks written as escapes."""
    out, escaped = [], False
    for c in regex:
        out.append("\\/" if c == "/" and not escaped else "\\n" if c == "\n" else c)
        escaped = c == "\\" and not escaped
    return "".join(out)


_LARK_TEXT = re.compile(r'"(?:\\.|[^"\\])*"|//[^\n]*|/(?:\\.|[^/\\\n])+/[imslux]*')   # strings, comments, regexes


def _renamed(lark: str, old: str, new: str) -> str:
    """A Lark grammar with the symbol `old` named `new`, wherever it is a symbol (not in strings, regexes, comments)."""
    word, out, at = re.compile(rf"(?<![\w.]){re.escape(old)}(?!\w)"), [], 0
    for m in _LARK_TEXT.finditer(lark):
        out += [word.sub(new, lark[at:m.start()]), m.group()]
        at = m.end()
    return "".join(out + [word.sub(new, lark[at:])])
