"""Tool-call formats of the chat templates people deploy (vLLM's tool parsers), each a `ToolFormat` in FORMATS: how
its calls are written, how a chat template is known to write them (`detect`), the grammar that holds a reply to
them (`grammar`: llguidance's Lark, the model free until it opens a call, the tools' schemas from there on), and a
reader that takes the calls out of the text as it streams (`CallReader`: OpenAI's tool_call deltas).

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>      Qwen2.5, Qwen3, Hermes
    llama3_json   [<|python_tag|>]{"name": "f", "parameters": {...}}; {...}          Llama 3.1 / 3.2 / 3.3
    json          {"name": "f", "arguments": {...}}, several [{...}, {...}]          a template that knows no tools

A hermes call may follow free text (the grammar is lazy: free text until the model writes `<tool_call>`); a
llama3_json or json reply is calls when its first character opens one (`{`, or the `<|python_tag|>` token; `[`
for json's several), text otherwise, as Meta's format and vLLM's parser have it.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

from specrt.decoding.grammar import JSON_LAYOUT

AUTO = "auto"


@dataclass(frozen=True)
class ToolFormat:
    """How a template writes its calls: each a JSON object {"name": ..., <arguments>: {...}} between `open` and
    `close` (either may be ""), calls apart by `separator` (`array`: several calls are a JSON array, one a bare
    object); `prefix`, a token that may come before the calls (Llama's <|python_tag|>); `lazy`: a call may follow
    free text (else a reply is calls only if it begins with one); `detect`: strings of a chat template that say it
    writes this format."""
    name: str
    arguments: str
    open: str = ""
    close: str = ""
    separator: str = "\n"
    prefix: str = ""
    lazy: bool = False
    array: bool = False
    detect: tuple[str, ...] = ()

    @property
    def open_marker(self) -> str:
        return self.open.strip()

    @property
    def close_marker(self) -> str:
        return self.close.strip()

    def write(self, name: str, arguments) -> str:
        """A call as this format writes it (an earlier call in a prompt whose template knows no tools)."""
        return f"{self.open}{json.dumps({'name': name, self.arguments: arguments})}{self.close}"

    def instruction(self) -> str:
        """How a call is written, for a system message that lists the tools (completions.TOOLS_PROMPT)."""
        shape = f'{{"name": <the function\'s name>, "{self.arguments}": <its arguments as an object>}}'
        if self.array:
            return f"a JSON object {shape} (to call several, a JSON array of them)"
        return f"a JSON object {shape}" if not self.open else f"{self.open}{shape}{self.close}"

    def grammar(self, functions: list, required: bool, parallel: bool, specials: frozenset[str] = frozenset()) -> str:
        """The Lark grammar (llguidance's dialect) of a reply with `functions` (protocol.Function): `required`, one
        call or more (at most one without `parallel`) and nothing else; else free text, or the calls once the model
        opens one. Each call is one JSON schema, `anyOf` the tools' {"name": {"const": name}, <arguments>: their
        parameters}, written as json.dumps writes it. A marker that is one token of the tokenizer (`specials`: its
        added tokens) is that token (`<tool_call>`), any other its text (and the free text before it a lazy
        lexeme, which ends where the marker comes)."""
        def mark(s: str) -> str:
            return s if s in specials else json.dumps(s)

        def text(s: str) -> str:   # s's marker as a token or text, the whitespace around it as text
            m = s.strip()
            if not m:
                return json.dumps(s) if s else ""
            before, after = s[:s.index(m)], s[s.index(m) + len(m):]
            return " ".join(part for part in (json.dumps(before) if before else "", mark(m),
                                              json.dumps(after) if after else "") if part)

        schema = call_schema(functions[0], self.arguments) if len(functions) == 1 else \
            {"anyOf": [call_schema(f, self.arguments) for f in functions], "x-guidance": JSON_LAYOUT}
        lines = ["%llguidance {}", f"body: %json {json.dumps(schema)}"]
        close = text(self.close)
        lines.append(f"call: {text(self.open)} body {close}".replace("  ", " "))
        sep = json.dumps(self.separator)
        more = f"({sep}{'?' if self.lazy else ''} call)*" if parallel and not self.array else ""
        prefix = f"{self.prefix}? " if self.prefix and self.prefix in specials else ""
        calls = f"{prefix}call {more}"
        if self.array and parallel:
            calls = f'call | "[" call ({sep} call)* "]"'
        if required:
            lines.append(f"start: {calls}")
            return "\n".join(lines) + "\n"
        if self.lazy:
            lines.append("TEXT: /(.|\\n)*/")
            opening = (f"opening: TEXT {self.open_marker}" if self.open_marker in specials else
                       f"opening[lazy]: TEXT {json.dumps(self.open_marker)}")
            after = self.open[self.open.index(self.open_marker) + len(self.open_marker):]
            lines += [opening, f"first: opening {json.dumps(after) if after else ''} body {close}",
                      f"start: TEXT | first {more}"]
        else:   # a reply that does not begin with "{" (or the prefix token) is text
            plain = "[^{\\[]" if self.array else "[^{]"
            lines += [f"PLAIN: /{plain}(.|\\n)*/", f"start: PLAIN? | {calls}"]
        return "\n".join(line.rstrip() for line in lines) + "\n"


def call_schema(function, arguments: str = "arguments") -> dict:
    """The JSON schema of a call of `function` (protocol.Function): its name, then its parameters' schema as the
    arguments (`arguments`: their key), laid out as json.dumps writes JSON (grammar.JSON_LAYOUT)."""
    return {"type": "object", "properties": {"name": {"const": function.name},
                                             arguments: function.parameters or {"type": "object"}},
            "required": ["name", arguments], "additionalProperties": False, "x-guidance": JSON_LAYOUT}


FORMATS = {f.name: f for f in (
    ToolFormat("hermes", "arguments", "<tool_call>\n", "\n</tool_call>", "\n", lazy=True, detect=("<tool_call>",)),
    ToolFormat("llama3_json", "parameters", separator="; ", prefix="<|python_tag|>",
               detect=("<|python_tag|>", '"parameters"')),
    ToolFormat("json", "arguments", separator=", ", array=True),
)}


def detect(chat_template: str | None, asked: str = AUTO) -> ToolFormat:
    """The format a chat template writes its calls in (`asked`: a name of FORMATS, or auto: the first whose
    `detect` strings the template holds; json, the fallback, for a template that knows no tools)."""
    if asked != AUTO:
        return FORMATS[asked]
    template = chat_template or ""
    return next((f for f in FORMATS.values() if any(s in template for s in f.detect)), FORMATS["json"])


def new_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


# ---- reading calls out of the text ---------------------------------------------------------------------------------


class _Object:
    """One JSON object read a character at a time: its top-level members' keys and raw values as they come.
    `feed(c)` returns False where c cannot continue the object (then it is not one: the reader gives it up)."""
    WS = " \t\r\n"

    def __init__(self):
        self.state = "start"   # start, key, in_key, colon, value, after, done
        self.key = self.raw = ""
        self.depth, self.in_str, self.esc = 0, False, False
        self.members: dict[str, str] = {}

    def feed(self, c: str) -> tuple[bool, str]:
        """(c fits, the part of the value of the member `self.key` that c adds ("": none))."""
        s = self.state
        if s == "start":
            if c in self.WS:
                return True, ""
            self.state = "key"
            return c == "{", ""
        if s == "key":
            if c in self.WS:
                return True, ""
            if c == '"':
                self.state, self.key, self.esc = "in_key", '"', False
                return True, ""
            if c == "}" and not self.members:
                self.state = "done"
                return True, ""
            return False, ""
        if s == "in_key":
            self.key += c
            if self.esc:
                self.esc = False
            elif c == "\\":
                self.esc = True
            elif c == '"':
                try:
                    self.key = json.loads(self.key)
                except ValueError:
                    return False, ""
                self.state = "colon"
            return True, ""
        if s == "colon":
            if c in self.WS:
                return True, ""
            self.state, self.raw, self.depth, self.in_str, self.esc = "value", "", 0, False, False
            return c == ":", ""
        if s == "value":
            return self._value(c)
        if s == "after":
            if c in self.WS:
                return True, ""
            if c == ",":
                self.state = "key"
                return True, ""
            if c == "}":
                self.state = "done"
                return True, ""
            return False, ""
        return False, ""

    def _value(self, c: str) -> tuple[bool, str]:
        if not self.raw and c in self.WS:
            return True, ""
        if self.in_str:
            self.esc, self.in_str = (False, True) if self.esc else (c == "\\", c != '"')
        elif c == '"':
            self.in_str = True
        elif c in "{[":
            self.depth += 1
        elif c in "}]":
            if self.depth == 0:   # the object's end after a scalar
                self._end()
                return self.feed(c)[0], ""
            self.depth -= 1
        elif c == "," and self.depth == 0:
            self._end()
            return self.feed(c)[0], ""
        elif c in self.WS and self.depth == 0:
            self._end()
            return True, ""
        self.raw += c
        if self.depth == 0 and not self.in_str and (c in "}]" or c == '"' and len(self.raw) > 1):
            self._end()
        return True, c

    def _end(self) -> None:
        self.members[self.key] = self.raw
        self.state = "after"


class CallReader:
    """A reply's text in, OpenAI's answer out, as it streams: content deltas and tool_call deltas. A call's first
    delta carries its index, id, type and function name with `arguments: ""`; its arguments follow as the model
    writes them, in pieces. `calls` holds the calls so far, whole ({"id", "type", "function": {"name",
    "arguments"}}): the deltas joined, so that a non-streamed answer is the same reader fed at once.

    Text that does not make a call of a listed tool in the format (possible only where no grammar held the reply:
    another response_format, say) is content, as is all that follows it. `feed` returns (content, deltas); `end`
    what was held back at the end (a marker's beginning, a call cut short before its name: content)."""

    def __init__(self, fmt: ToolFormat, names: frozenset[str], parallel: bool = True):
        self.fmt, self.names, self.parallel = fmt, names, parallel
        self.calls: list[dict] = []
        self.state = "begin"      # begin, text, open, object, close, between, plain
        self.held = ""            # text that may turn out to be a marker or a call (not sent yet)
        self.obj: _Object | None = None
        self.pending = ""         # the current call's arguments not sent yet (its name not known yet)
        self.started = False      # the current call's first delta has been sent
        self.array = False        # the calls are in a JSON array (ToolFormat.array)

    def feed(self, text: str) -> tuple[str, list[dict]]:
        content, deltas = [], []
        for c in text:
            self._char(c, content, deltas)
        return "".join(content), _merged(deltas)

    def end(self) -> str:
        """The content held back at the end of the reply: a marker's beginning, or a call cut short before its
        first delta (a call cut short after it stays as far as it came; whitespace after the calls is dropped)."""
        held = self.held if self.state in ("begin", "text", "open") or self.state == "object" and not self.started \
            else ""
        self.held, self.state = "", "plain"
        return held

    def _char(self, c: str, content: list, deltas: list) -> None:
        fmt, state = self.fmt, self.state
        if state == "begin":   # the reply's first character: calls only if it opens one (unless lazy)
            if fmt.lazy:
                self.state = "text"
            elif fmt.prefix and fmt.prefix.startswith(self.held + c) and self.held + c != "{":
                self.held += c
                self.state = "open" if self.held == fmt.prefix else "begin"
                return
            elif fmt.array and c == "[" and not self.held:
                self.state, self.held, self.array = "between", "[", True
                return
            else:
                self.state = "open" if c == "{" and not self.held else "plain"
                if self.state == "plain":
                    content.append(self.held)
                    self.held = ""
            return self._char(c, content, deltas)
        if state == "plain":
            content.append(c)
        elif state == "text":   # free text until the open marker
            self.held += c
            marker = fmt.open_marker
            if self.held.endswith(marker):
                content.append(self.held[:-len(marker)])
                self.held, self.state = marker, "open"
                return
            keep = next((k for k in range(min(len(marker) - 1, len(self.held)), 0, -1)
                         if marker.startswith(self.held[-k:])), 0)
            content.append(self.held[:len(self.held) - keep])
            self.held = self.held[len(self.held) - keep:]
        elif state == "open":   # after the marker: whitespace, then the object
            self.held += c
            if c in _Object.WS:
                return
            if c != "{":
                return self._give_up(content)
            self.obj, self.pending, self.started = _Object(), "", False
            self.obj.feed(c)
            self.state = "object"
        elif state == "object":
            self.held += c
            fits, part = self.obj.feed(c)
            if not fits:
                return self._give_up(content)
            if part and self.obj.key == fmt.arguments:
                self.pending += part
            self._send(deltas)
            if self.obj.state == "done":
                self._call_done(content, deltas)
        elif state == "close":   # whitespace, then the close marker
            self.held += c
            seen = self.held.lstrip(_Object.WS)
            if seen and not fmt.close_marker.startswith(seen):
                return self._give_up(content)
            if seen == fmt.close_marker:
                self.held, self.state = "", "between"
        elif state == "after":   # the end of the array: whitespace, and nothing else
            if c not in _Object.WS:
                self.held = c
                self._give_up(content)
        elif state == "between":   # the separator and whitespace, then another call or text
            self.held += c
            gap = _Object.WS + fmt.separator.strip() + ("[" if self.array else "")
            rest = self.held.lstrip(gap)
            marker = fmt.open_marker or "{"
            if not rest:
                return
            if self.array and rest == "]" and self.calls:
                self.held, self.state = "", "after"
                return
            if not self.parallel or not marker.startswith(rest):
                return self._give_up(content)
            if rest == marker:
                self.state = "open"
                if marker == "{":   # the marker is the object's first character
                    self.held = self.held[:-1]
                    self._char(c, content, deltas)

    def _send(self, deltas: list) -> None:
        """The call's first delta once its name is known and its arguments have begun, then its arguments as
        they come."""
        if not self.started and self.pending:
            name = _string(self.obj.members.get("name"))
            if name not in self.names:
                return
            self.started = True
            self.calls.append({"id": new_id(), "type": "function", "function": {"name": name, "arguments": ""}})
            deltas.append({"index": len(self.calls) - 1, **self.calls[-1],
                           "function": {"name": name, "arguments": ""}})
        if self.started and self.pending:
            self.calls[-1]["function"]["arguments"] += self.pending
            deltas.append({"index": len(self.calls) - 1, "function": {"arguments": self.pending}})
            self.pending = ""

    def _call_done(self, content: list, deltas: list) -> None:
        if not self.started:   # its name came after its arguments, or is not a listed tool's
            self._send(deltas)
            if not self.started:
                return self._give_up(content)
        self.held, self.obj = "", None
        self.state = "close" if self.fmt.close_marker else "between"

    def _give_up(self, content: list) -> None:
        """What was held is text, not a call, and so is the rest of the reply (the calls sent stay; one whose
        arguments were being sent ends there)."""
        if self.state != "object" or not self.started:
            content.append(self.held)
        self.held, self.state = "", "plain"


def _string(raw: str | None) -> str | None:
    try:
        value = json.loads(raw) if raw is not None else None
    except ValueError:
        return None
    return value if isinstance(value, str) else None


def _merged(deltas: list[dict]) -> list[dict]:
    """Consecutive argument pieces of one call as one delta (a call's first delta stays its own)."""
    out = []
    for d in deltas:
        if out and "id" not in d and "id" not in out[-1] and out[-1]["index"] == d["index"]:
            out[-1] = {"index": d["index"], "function": {"arguments": out[-1]["function"]["arguments"] +
                                                         d["function"]["arguments"]}}
        else:
            out.append(d)
    return out
