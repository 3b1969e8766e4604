"""Tool calls in a model's free text, for ``tool_choice`` "auto" (vLLM's ``--enable-auto-tool-choice
--tool-call-parser``).

With "auto" nothing constrains the output: the model decides whether to call a tool, in the format its chat template
taught it, and a parser finds the calls in what it wrote. Three parsers:

- ``hermes``: calls between ``<tool_call>`` and ``</tool_call>`` tags (Hermes, Qwen 2/2.5/3, SmolLM2 and SmolLM3).
  A block holds one call ``{"name": ..., "arguments": {...}}`` or a JSON list of them (SmolLM2's form; ``[]`` is
  "no call"); ``"parameters"`` is read as ``"arguments"``, arguments given as a JSON string are kept as that
  string, and ``null`` or ``""`` are no arguments, ``{}`` (vLLM passes ``"null"`` / ``"\"\""`` on, which is no
  JSON object; here such a block was no call at all).

- ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 instruct): an answer that is a call is only the call, one JSON object
  ``{"name": ..., "parameters": {...}}`` (or several separated by ``;``), maybe after ``<|python_tag|>``. An answer
  that starts with ``{`` (or the tag) is held until it ends, then is calls if it parses as such, else content as
  written; any other answer streams as content.
- ``pythonic`` (Llama 3.2 and 4): an answer that is only a Python list of calls with keyword arguments of literals,
  ``[get_weather(city="Paris"), get_time(zone="UTC")]`` (Llama 4: between ``<|python_start|>`` and
  ``<|python_end|>``), held and read the same way (with ``ast``: nothing but literals is evaluated).

Text outside the blocks is the answer's content. A block that is not such JSON (strict JSON: no NaN or Infinity; or
is still open when the output ends, e.g. cut by ``max_tokens``) stays in the content as written, tags and all, so
nothing the model wrote is lost; when it holds another start tag, the text after the last one is tried as the block
(``<tool_call>`` written in prose before a real call). A ``</tool_call>`` inside a JSON string ends the block
there (as in vLLM's parser): that call stays content. Calls are not checked against the request's tools (nor in
vLLM): a name the model made up is passed on as written. Arguments holding a lone UTF-16 surrogate (an escape
UTF-8 cannot carry) go out escaped, as ASCII JSON; a name holding one is not a call.

Streaming (:class:`ToolCallStream`) holds back only what could still be the start of a tag or is inside an open
block, and sends each call whole once its block closes. Its content, joined, and its calls equal :func:`parse` of
the whole text, whatever the pieces (it is how :func:`parse` works).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

TOOL_CALL_PARSERS = ("hermes", "llama3_json", "pythonic")


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text (OpenAI's ``function.arguments``)


def _reject_constant(name: str) -> None:
    raise ValueError(f"{name} is not JSON")  # (NaN, Infinity: Python's json reads them, strict parsers do not)


def strict_json(text: str) -> Any:
    """``json.loads`` for what a model wrote: NaN / Infinity and nesting past the interpreter's recursion limit are
    errors (ValueError), as for any strict JSON parser a client runs."""
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None


def _encodes(text: str) -> bool:
    """Whether ``text`` encodes as UTF-8 (no lone UTF-16 surrogate)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def json_text(value: Any) -> str:
    """``value`` as JSON text that encodes as UTF-8: non-ASCII as written, but escaped when a string holds a lone
    UTF-16 surrogate (from a ``\\ud800`` escape in the model's text, which UTF-8 cannot carry)."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)  # (ValueError for a number read as inf: 1e400
    return text if _encodes(text) else json.dumps(value)             # written back would be Infinity, not JSON)


def _calls_in(body: str) -> list[ToolCall] | None:
    """The calls one block holds, or None when it is not a call (or a list of them)."""
    try:
        value = strict_json(body)
    except ValueError:
        return None
    return _calls_of(value)


def _calls_of(value: Any) -> list[ToolCall] | None:
    """The calls a parsed JSON value is (one call object, or a list of them), or None."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        name = item.get("name") if isinstance(item, dict) else None
        if not isinstance(name, str) or not name or not _encodes(name):  # (a function name is plain text)
            return None
        arguments = item.get("arguments")
        if arguments is None or arguments == "":  # ("parameters" then; neither: a function without arguments)
            arguments = item.get("parameters")
        if arguments is None or arguments == "":
            arguments = {}
        if isinstance(arguments, str):
            try:
                parsed = strict_json(arguments)
            except ValueError:
                return None
            if not isinstance(parsed, dict):
                return None
            # (text is kept as written, unless it holds a surrogate escape the outer string decoded: written again)
            rewrite = None if _encodes(arguments) else parsed
        elif isinstance(arguments, dict):
            rewrite = arguments
        else:
            return None
        if rewrite is not None:
            try:
                arguments = json_text(rewrite)
            except ValueError:  # (a number past a double's range: kept as the model wrote it, content)
                return None
        calls.append(ToolCall(name, arguments))
    return calls


@dataclass
class ToolCallStream:
    """Finds tool calls in text that arrives in pieces: :meth:`feed` each piece, then :meth:`finish`; each returns
    the content that is now certain and the calls whose blocks closed."""

    start: str = "<tool_call>"
    end: str = "</tool_call>"
    _held: str = ""  # outside a block: a tail that could begin the start tag
    _body: list[str] | None = None  # inside a block: its text so far, in the pieces that came (joined once it closes)
    _tail: str = ""  # inside a block: its text's last len(end) - 1 characters (where an end tag may have begun)
    _gap: str = ""  # after a call: whitespace held until text follows it (at the end it is dropped)
    calls: list[ToolCall] = field(default_factory=list)  # every call so far

    def _content(self, text: str, after_call: bool) -> str:
        """Content text as it may go out: after a call, whitespace is held (the newlines between and after blocks
        are no content: vLLM's hermes parser answers content null there) until other text follows it."""
        if not after_call:
            return text
        text = self._gap + text
        kept = text.rstrip()
        self._gap = text[len(kept):]
        return kept

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        content, calls = [], []
        text = self._held + text
        self._held = ""
        while text:
            after_call = bool(self.calls or calls)
            if self._body is None:
                at = text.find(self.start)
                if at < 0:
                    keep = prefix_tail(text, self.start)
                    content.append(self._content(text[:len(text) - keep], after_call))
                    self._held = text[len(text) - keep:]
                    break
                content.append(self._content(text[:at], after_call))
                self._body, self._tail, text = [], "", text[at + len(self.start):]
            else:
                # (only the new text and the tail before it can hold the end tag: searching, or joining, the whole
                # block at every piece made a long call's stream quadratic, seconds for a 280 KB block)
                probe = self._tail + text
                at = probe.find(self.end)
                if at < 0:
                    self._body.append(text)
                    self._tail = probe[max(0, len(probe) - (len(self.end) - 1)):]
                    break
                body = "".join(self._body)
                body = body[:len(body) - len(self._tail)] + probe
                at += len(body) - len(probe)
                lead, found = _block(body[:at], self.start)
                if found is None:
                    content.append(self._content(self.start + body[:at] + self.end, after_call))
                else:
                    if lead is not None:  # (a start tag written before the real one: text)
                        content.append(self._content(self.start + lead, after_call))
                    calls += found
                self._body, text = None, body[at + len(self.end):]
        self.calls += calls
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The end of the output: held text becomes content, and so does an unclosed block, unless its text is a
        whole call (as vLLM's hermes parser reads ``<tool_call>(.*)`` at the end: a ``stop`` at ``</tool_call>``, or
        an end-of-sequence token before it), which is a call."""
        if self._body is None:
            rest, found = self._held, []
        else:
            body = "".join(self._body)
            lead, calls = _block(body, self.start)
            if calls:
                rest, found = (self.start + lead) if lead is not None else "", calls
            else:
                rest, found = self.start + body, []
        rest = self._content(rest, bool(self.calls))
        self._held, self._body, self._tail, self._gap = "", None, "", ""  # (whitespace after the last call: dropped)
        self.calls += found
        return rest, found


def _block(body: str, start: str) -> tuple[str | None, list[ToolCall] | None]:
    """A closed block's calls; when its text is not a call but holds another start tag (``<tool_call>`` written in
    prose, or twice), the calls after the last such tag, with the text before it (else None)."""
    found = _calls_in(body)
    if found is not None or start not in body:
        return None, found
    k = body.rfind(start)
    return body[:k], _calls_in(body[k + len(start):])


def prefix_tail(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def parse(text: str, parser: str = "hermes") -> tuple[str, list[ToolCall]]:
    """The content and tool calls in a whole output."""
    stream = make_stream(parser)
    content, calls = stream.feed(text)
    rest, more = stream.finish()
    return content + rest, calls + more


@dataclass
class WholeAnswerToolCallStream:
    """Formats where a call is the whole answer (llama3_json, pythonic): an answer that opens with ``opener`` (after
    whitespace, or after ``tag``) is held whole and read as calls by ``read`` at its end; any other answer is content
    as it comes. The same ``feed`` / ``finish`` / ``calls`` as :class:`ToolCallStream`."""

    tag: str
    opener: str
    read: Any  # the held answer (its tag taken off) -> calls, or None when it is not only calls
    _held: str = ""
    _state: str = "opening"  # "opening" (only whitespace so far), "call" (held to the end), "text"
    calls: list[ToolCall] = field(default_factory=list)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._state == "text":
            return text, []
        self._held += text
        if self._state == "opening":
            start = self._held.lstrip()
            if not start or (self.tag.startswith(start) and start != self.tag):
                return "", []  # (whitespace, or maybe the tag: undecided)
            if start.startswith(self.opener) or start.startswith(self.tag):
                self._state = "call"
            else:
                self._state, held, self._held = "text", self._held, ""
                return held, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        held, self._held = self._held, ""
        if self._state != "call":
            return held, []
        found = self.read(held.strip().removeprefix(self.tag))
        if found is None:
            return held, []
        self.calls += found
        return "", found


def _pythonic_calls(text: str) -> list[ToolCall] | None:
    """Calls written as a Python list of calls with keyword arguments of literals, ``[f(a=1), g(b="x")]`` (Llama 3.2
    and 4 write these; Llama 4 between ``<|python_start|>`` and ``<|python_end|>``); None: not only calls. Read with
    ``ast`` (nothing is evaluated but literals)."""
    import ast

    text = text.strip().removesuffix("<|python_end|>").strip()
    try:
        tree = ast.parse(text, mode="eval").body
    except (SyntaxError, ValueError, RecursionError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for node in tree.elts:
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and not node.args
                and all(k.arg is not None for k in node.keywords)):
            return None
        try:
            arguments = {k.arg: ast.literal_eval(k.value) for k in node.keywords}
            text_args = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
        except (ValueError, TypeError, SyntaxError, RecursionError):  # (not a literal, or not JSON: a set, NaN, ...)
            return None
        calls.append(ToolCall(node.func.id, text_args if _encodes(text_args) else json.dumps(arguments)))
    return calls


def _json_calls(text: str) -> list[ToolCall] | None:
    """Calls written as JSON objects one after another, separated by ``;`` (None: not only calls)."""
    decoder, calls, at = json.JSONDecoder(parse_constant=_reject_constant), [], 0
    while True:
        while at < len(text) and (text[at].isspace() or (calls and text[at] == ";")):
            at += 1
        if at == len(text):
            return calls or None
        try:
            value, end = decoder.raw_decode(text, at)
        except (ValueError, RecursionError):
            return None
        found = _calls_of(value) if isinstance(value, dict) else None
        if found is None:
            return None
        calls += found
        at = end


def make_stream(parser: str) -> ToolCallStream | WholeAnswerToolCallStream:
    if parser not in TOOL_CALL_PARSERS:
        raise ValueError(f"unknown tool-call parser {parser!r}: choose one of {', '.join(TOOL_CALL_PARSERS)}")
    if parser == "llama3_json":
        return WholeAnswerToolCallStream("<|python_tag|>", "{", _json_calls)
    if parser == "pythonic":
        return WholeAnswerToolCallStream("<|python_start|>", "[", _pythonic_calls)
    return ToolCallStream()


def tool_calls_json(calls: list[ToolCall], first_index: int = 0, streamed: bool = False) -> list[dict[str, Any]]:
    """OpenAI's ``tool_calls`` entries (with ``index`` when ``streamed``, counting from ``first_index``)."""
    import uuid

    out = []
    for k, call in enumerate(calls):
        entry = {"id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}
        out.append({"index": first_index + k, **entry} if streamed else entry)
    return out


class RequiredCallsStream:
    """Streams the calls of a ``tool_choice: "required"`` answer as they are written: its text is the constrained
    JSON array ``[{"name": ..., "parameters": {...}}, ...]`` (a prefix of one while it streams). :meth:`feed` takes
    the new text and returns OpenAI's streamed ``tool_calls`` deltas: a call's first (``index``, ``id``, ``type``,
    its name and the arguments so far) once its name is complete, then its arguments' new text as it comes (the raw
    JSON of ``parameters``, as vLLM streams them: whitespace as the model wrote it).

    A scan over the characters: the containers open, whether it is in a string, and in each call object the key read
    last and where the ``parameters`` value starts and ends (the end: the container that value opened closing, or
    for a scalar, the ``,`` or ``}`` after it)."""

    def __init__(self):
        self.text = ""
        self._pos = 0  # scanned up to here
        self._depth = 0
        self._in_string = False
        self._escape = False
        self._string_start = 0
        self._expect_key = False  # (at depth 2: the next string is a key)
        self._key: str | None = None
        self._value_start: int | None = None  # (at depth 2, after a key's ':': where its value starts)
        self.calls: list[dict[str, Any]] = []  # per call: name, args_start, args_end, sent, started

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.text += text
        self._scan()
        return self._deltas()

    def _scan(self) -> None:
        text = self.text
        for i in range(self._pos, len(text)):
            c = text[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif c == "\\":
                    self._escape = True
                elif c == '"':
                    self._in_string = False
                    if self._depth == 2:
                        self._string_done(text[self._string_start:i + 1])
                continue
            call = self.calls[-1] if self.calls and self._depth >= 2 else None
            if self._depth == 2 and self._value_start is None and self._key is not None and not c.isspace() \
                    and c not in ":,}":
                self._value_start = i
                if self._key == "parameters" and call is not None:
                    call["args_start"] = i
            if c == '"':
                self._in_string, self._string_start = True, i
            elif c in "[{":
                self._depth += 1
                if self._depth == 2 and c == "{":
                    self.calls.append({"name": None, "args_start": None, "args_end": None, "sent": 0,
                                       "started": False})
                    self._expect_key, self._key, self._value_start = True, None, None
            elif c in "]}":
                if self._depth == 2:
                    self._value_done(i)
                self._depth -= 1
                if self._depth == 2 and call is not None and self._key == "parameters" \
                        and call["args_end"] is None and call["args_start"] is not None:
                    call["args_end"] = i + 1  # (the parameters object closed)
            elif c == "," and self._depth == 2:
                self._value_done(i)
                self._expect_key, self._key, self._value_start = True, None, None
        self._pos = len(text)

    def _string_done(self, raw: str) -> None:
        if self._expect_key:
            try:
                self._key = json.loads(raw)
            except ValueError:
                self._key = None
            self._expect_key, self._value_start = False, None
        elif self._key == "name" and self.calls:
            try:
                self.calls[-1]["name"] = json.loads(raw)
            except ValueError:
                pass

    def _value_done(self, end: int) -> None:
        """A value at depth 2 ended at ``end`` (a ``,`` or the object's ``}``): a scalar parameters value ends here."""
        call = self.calls[-1] if self.calls else None
        if call is not None and self._key == "parameters" and call["args_start"] is not None \
                and call["args_end"] is None:
            call["args_end"] = len(self.text[:end].rstrip())

    def named_calls(self) -> list[ToolCall]:
        """The calls whose name is complete, each with its ``parameters`` text so far (raw, as streamed)."""
        out = []
        for call in self.calls:
            if isinstance(call["name"], str):
                start, end = call["args_start"], call["args_end"]
                args = "" if start is None else self.text[start:len(self.text) if end is None else end]
                out.append(ToolCall(call["name"], args))
        return out

    def _deltas(self) -> list[dict[str, Any]]:
        import uuid

        out = []
        for k, call in enumerate(self.calls):
            if not isinstance(call["name"], str):
                continue  # (its name is not complete yet: nothing goes out before it)
            args = ""
            if call["args_start"] is not None:
                end = call["args_end"] if call["args_end"] is not None else len(self.text)
                args = self.text[call["args_start"] + call["sent"]:end]
                call["sent"] += len(args)
            if not call["started"]:
                call["started"] = True
                out.append({"index": k, "id": f"chatcmpl-tool-{uuid.uuid4().hex}", "type": "function",
                            "function": {"name": call["name"], "arguments": args}})
            elif args:
                out.append({"index": k, "function": {"arguments": args}})
        return out


def required_calls(text: str) -> tuple[list[ToolCall], bool]:
    """A ``tool_choice: "required"`` answer's calls, as :class:`RequiredCallsStream` streams them (raw ``parameters``
    text, so a whole answer and its stream agree), and whether the array is complete (cut short by ``max_tokens`` or
    a stop string, it holds the calls named so far, their arguments as far as they go)."""
    stream = RequiredCallsStream()
    stream.feed(text)
    try:
        strict_json(text)
        complete = True
    except (ValueError, TypeError):
        complete = False
    return stream.named_calls(), complete
