"""The tool-call parser for tool_choice "auto" (no engine): what it finds in whole outputs, and that streaming it in
any pieces gives the same content and calls."""

from __future__ import annotations

import json
import random

import pytest

from nightjar_jax.server import tool_parsers
from nightjar_jax.server.protocol import APIError, ChatCompletionRequest
from nightjar_jax.server.tool_parsers import RequiredCallsStream, ToolCall, parse

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}

CASES = [
    # (output, content, calls)
    ("Hello there.", "Hello there.", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>', "",
     [ToolCall("get_weather", '{"city": "Paris"}')]),
    # SmolLM2's form: a list in one block, "parameters" for "arguments", text around it
    ('Sure. <tool_call>[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call> Done.',
     "Sure.  Done.", [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]),
    # two blocks; arguments given as a JSON string stay that string; non-ASCII kept as written; the whitespace
    # between and after blocks is no content (vLLM's hermes parser: null; "\n" came out, QA 2026-12-07)
    ('<tool_call>{"name": "a", "arguments": "{\\"q\\": 1}"}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"city": "Zürich"}}</tool_call>\n', "", [ToolCall("a", '{"q": 1}'), ToolCall("b", '{"city": "Zürich"}')]),
    # ... unless text follows it: then it is that text's (and the whitespace that ends the output is not)
    ('<tool_call>{"name": "a"}</tool_call>\n\nDone.\n', "\n\nDone.", [ToolCall("a", "{}")]),
    ('<tool_call>{"name": "a"}</tool_call>\n <tool_call>oops</tool_call>', "\n <tool_call>oops</tool_call>",
     [ToolCall("a", "{}")]),
    ('\n<tool_call>{"name": "a"}</tool_call> \n<tool_call>{"name": "b", "argu', '\n \n<tool_call>{"name": "b", "argu',
     [ToolCall("a", "{}")]),
    # "[]": no call; the block is gone
    ("<tool_call>[]</tool_call>No tool fits.", "No tool fits.", []),
    # arguments null or "": no arguments (they were no call, the block left in the content)
    ('<tool_call>{"name": "a", "arguments": null}</tool_call><tool_call>{"name": "b", "arguments": ""}</tool_call>',
     "", [ToolCall("a", "{}"), ToolCall("b", "{}")]),
    ('<tool_call>{"name": "a", "arguments": null, "parameters": {"x": 1}}</tool_call>', "",
     [ToolCall("a", '{"x": 1}')]),
    # not a call: kept as written, tags and all
    ("<tool_call>oops</tool_call>", "<tool_call>oops</tool_call>", []),
    ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>', []),
    ('<tool_call>{"name": "a", "arguments": [1]}</tool_call>', '<tool_call>{"name": "a", "arguments": [1]}</tool_call>',
     []),
    ('<tool_call>{"name": "a", "arguments": "not json"}</tool_call>',
     '<tool_call>{"name": "a", "arguments": "not json"}</tool_call>', []),
    # cut before the block closed (max_tokens): content, not lost
    ('Let me look. <tool_call>{"name": "get_weather", "argu', 'Let me look. <tool_call>{"name": "get_weather", "argu',
     []),
    # a last block never closed that holds a whole call (a stop at </tool_call>, or EOS before it): a call, as
    # vLLM's hermes parser reads it (it was content)
    ('Sure. <tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}\n', "Sure. ",
     [ToolCall("get_weather", '{"city": "Paris"}')]),
    # strict JSON only: NaN / Infinity and nesting past the recursion limit are not calls (kept as written)
    ('<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>',
     '<tool_call>{"name": "a", "arguments": {"x": NaN}}</tool_call>', []),
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": Infinity}"}</tool_call>',
     '<tool_call>{"name": "a", "arguments": "{\\"x\\": Infinity}"}</tool_call>', []),
    # a number past a double's range read as inf, and written back as Infinity (not JSON): not a call either
    ('<tool_call>{"name": "a", "arguments": {"x": 1e400}}</tool_call>',
     '<tool_call>{"name": "a", "arguments": {"x": 1e400}}</tool_call>', []),
    # arguments as text: kept as written (1e400 is JSON text), unless they must be written again (a surrogate
    # escape the outer string decoded), which inf cannot be: then content (it was a ValueError out of parse)
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1e400}"}</tool_call>', "", [ToolCall("a", '{"x": 1e400}')]),
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1e400, \\"y\\": \\"\\ud800\\"}"}</tool_call>',
     '<tool_call>{"name": "a", "arguments": "{\\"x\\": 1e400, \\"y\\": \\"\\ud800\\"}"}</tool_call>', []),
    ("<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>", "<tool_call>" + "[" * 5000 + "]" * 5000 + "</tool_call>",
     []),
    # a lone surrogate escape: arguments go out as ASCII JSON (UTF-8 cannot carry it); in a name, not a call
    ('<tool_call>{"name": "a", "arguments": {"x": "\\ud800 é"}}</tool_call>', "",
     [ToolCall("a", '{"x": "\\ud800 \\u00e9"}')]),
    ('<tool_call>{"name": "a", "arguments": "{\\"x\\": \\"\\ud800\\"}"}</tool_call>', "",
     [ToolCall("a", '{"x": "\\ud800"}')]),
    ('<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "\\ud800", "arguments": {}}</tool_call>', []),
    # a start tag written in prose before the real one, or twice: the call after the last one
    ('I will use <tool_call> now: <tool_call>{"name": "a"}</tool_call>', "I will use <tool_call> now: ",
     [ToolCall("a", "{}")]),
    ('<tool_call><tool_call>{"name": "a"}</tool_call>', "<tool_call>", [ToolCall("a", "{}")]),
    # a tag's start at the very end, and text that only looks like one
    ("a <tool_ca", "a <tool_ca", []),
    ("x < y <tool> <tool_cal z", "x < y <tool> <tool_cal z", []),
]


# llama3_json: an answer that is only calls (one JSON object each, ";" between, maybe after <|python_tag|>)
LLAMA_CASES = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [ToolCall("get_weather", '{"city": "Paris"}')]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"x": 1}}', "",
     [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')]),
    ('\n {"name": "a"};', "", [ToolCall("a", "{}")]),
    ("Paris is sunny today.", "Paris is sunny today.", []),
    ('Sure: {"name": "a"}', 'Sure: {"name": "a"}', []),  # (a call is the whole answer)
    ('{"name": "a"} and more', '{"name": "a"} and more', []),
    ('{"city": "Paris"}', '{"city": "Paris"}', []),  # (JSON, but no call)
    ('{"name": "a", "parameters": {"x": NaN}}', '{"name": "a", "parameters": {"x": NaN}}', []),
    ('{"name": "get_weather", "param', '{"name": "get_weather", "param', []),  # (cut by max_tokens)
    ("<|python", "<|python", []),
    ("  ", "  ", []),
]
# pythonic: an answer that is only a Python list of calls with keyword arguments of literals
PY_CASES = [
    ('[get_weather(city="Paris", days=3), get_time(zone="UTC")]', "",
     [ToolCall("get_weather", '{"city": "Paris", "days": 3}'), ToolCall("get_time", '{"zone": "UTC"}')]),
    ('<|python_start|>[f(a=[1, 2], b={"x": None, "y": True})]<|python_end|>', "",
     [ToolCall("f", '{"a": [1, 2], "b": {"x": null, "y": true}}')]),
    (' [f()]', "", [ToolCall("f", "{}")]),
    ("[f(1)]", "[f(1)]", []),  # (positional arguments have no names)
    ('[f(a=open("x"))]', '[f(a=open("x"))]', []),  # (only literals: nothing is called)
    ('[os.system(a="x")]', '[os.system(a="x")]', []),
    ("[f(a=1e999)]", "[f(a=1e999)]", []),  # (infinity is not JSON)
    ("[]", "[]", []),
    ("[1, 2] is a list", "[1, 2] is a list", []),
    ("It is sunny.", "It is sunny.", []),
    ("[f(a=", "[f(a=", []),  # (cut by max_tokens)
]
ALL_CASES = ([("hermes", *c) for c in CASES] + [("llama3_json", *c) for c in LLAMA_CASES]
             + [("pythonic", *c) for c in PY_CASES])


@pytest.mark.parametrize("parser,text,content,calls", ALL_CASES)
def test_parse(parser, text, content, calls):
    assert parse(text, parser) == (content, calls)


@pytest.mark.parametrize("parser,text,content,calls", ALL_CASES)
def test_streamed_in_any_pieces_equals_parse(parser, text, content, calls):
    """Every split into 1-4 character pieces, and random splits: the same content (joined) and calls; content that
    could still begin a tag is held back, and no call's block goes out as content."""
    rng = random.Random(0)
    splits = [[1] * len(text), [2] * len(text), [4] * len(text)] + [
        [rng.randint(1, 12) for _ in text] for _ in range(20)]
    for sizes in splits:
        stream = tool_parsers.make_stream(parser)
        pieces, at = [], 0
        for size in sizes:
            if at >= len(text):
                break
            pieces.append(text[at:at + size])
            at += size
        out, found = [], []
        for piece in pieces:
            c, f = stream.feed(piece)
            out.append(c)
            found += f
            assert "</tool_call>" not in c or "</tool_call>" in content, "a call's block went out as content"
            assert not calls or ('"name"' not in c and "(" not in c), "a call went out as content"
        rest, more = stream.finish()
        assert ("".join(out) + rest, found + more) == (content, calls)
        assert stream.calls == calls


def test_held_back_only_a_possible_tag():
    stream = tool_parsers.make_stream("hermes")
    assert stream.feed("Hi <tool") == ("Hi ", [])
    assert stream.feed("box") == ("<toolbox", [])
    assert stream.feed(' <tool_call>{"name": "a"}') == (" ", [])
    assert stream.feed("</tool_call>!") == ("!", [ToolCall("a", "{}")])


def test_llama3_json_streams_prose_at_once():
    stream = tool_parsers.make_stream("llama3_json")
    assert stream.feed(" ") == ("", [])
    assert stream.feed("It is") == (" It is", [])
    assert stream.feed(' {"name": "a"}') == (' {"name": "a"}', [])
    assert stream.finish() == ("", [])


def test_unknown_parser_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral': choose one of hermes, llama3_json, "
                                         "pythonic"):
        tool_parsers.make_stream("mistral")


def test_tool_calls_json_shapes():
    calls = [ToolCall("a", "{}"), ToolCall("b", '{"x": 1}')]
    plain = tool_parsers.tool_calls_json(calls)
    assert [c["function"] for c in plain] == [{"name": "a", "arguments": "{}"}, {"name": "b", "arguments": '{"x": 1}'}]
    assert all(c["type"] == "function" and c["id"].startswith("chatcmpl-tool-") and "index" not in c for c in plain)
    assert len({c["id"] for c in plain}) == 2
    streamed = tool_parsers.tool_calls_json(calls, first_index=3, streamed=True)
    assert [c["index"] for c in streamed] == [3, 4]


def test_auto_needs_a_parser_and_sets_no_constraint():
    """Without the server's parser, "auto" (also the default with tools) is a 400 that names the flags; with one it
    constrains nothing, and a format the request sets still applies (other tool choices refuse a second one)."""
    body = {"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER]}
    for choice in (None, "auto"):
        req = ChatCompletionRequest(**body, **({} if choice is None else {"tool_choice": choice}))
        with pytest.raises(APIError, match="--enable-auto-tool-choice --tool-call-parser hermes") as err:
            req.tool_call()
        assert err.value.param == "tool_choice"
        req.allow_auto_tools("hermes")
        assert req.tool_call() == ("auto", [{"name": "get_weather", "parameters": {"type": "object"}}])
        assert req.structured() is None
    regex = {"regex": "<tool_call>.*</tool_call>"}
    req = ChatCompletionRequest(**body, structured_outputs=regex)
    req.allow_auto_tools("hermes")
    assert req.structured() == regex
    req = ChatCompletionRequest(**body, structured_outputs=regex, tool_choice="required")
    with pytest.raises(APIError, match="one output constraint"):
        req.structured()
    assert json.loads(json.dumps(req.tool_call()[1])) == [{"name": "get_weather", "parameters": {"type": "object"}}]


def _joined(deltas: list[dict]) -> dict[int, tuple[str, str]]:
    calls: dict[int, list] = {}
    for d in deltas:
        call = calls.setdefault(d["index"], [None, ""])
        if "id" in d:
            assert call[0] is None and d["id"].startswith("chatcmpl-tool-") and d["type"] == "function"
            call[0] = d["function"]["name"]
        else:
            assert call[0] is not None  # (no arguments before the call's first delta, which names it)
        call[1] += d["function"]["arguments"]
    return {k: tuple(v) for k, v in calls.items()}


@pytest.mark.parametrize("seed", range(5))
def test_required_calls_stream_in_any_pieces(seed):
    """``tool_choice: "required"``'s JSON array streams call by call, the arguments as they come, in whatever
    pieces the text arrives: each call's pieces join to its raw ``parameters`` JSON (escapes, nesting, a
    ``parameters`` before the ``name``, a scalar)."""
    text = ('[ {"name": "get_weather", "parameters": {"city": "Pa\\"ris}", "n": [1, {"a": "]"}]}},\n'
            '{"parameters": {"zone": "UTC"}, "name": "get_time"}, {"name": "x", "parameters": 5} ]')
    rng = random.Random(seed)
    stream, deltas, i = RequiredCallsStream(), [], 0
    while i < len(text):
        j = i + rng.randint(1, 6)
        deltas += stream.feed(text[i:j])
        i = j
    assert _joined(deltas) == {0: ("get_weather", '{"city": "Pa\\"ris}", "n": [1, {"a": "]"}]}'),
                               1: ("get_time", '{"zone": "UTC"}'), 2: ("x", "5")}
    # a call whose parameters came first goes out whole once its name is read
    first_of_1 = next(d for d in deltas if d["index"] == 1)
    assert first_of_1["function"]["arguments"] == '{"zone": "UTC"}'


def test_required_calls_stream_cut_short():
    """An answer cut short (max_tokens) streams what it holds, with no error."""
    stream = RequiredCallsStream()
    assert stream.feed('[{"na') == []
    (first,) = stream.feed('me": "f", "parameters": {"a": [1, 2')
    assert first["function"] == {"name": "f", "arguments": '{"a": [1, 2'}
    assert stream.feed("") == []


def test_a_long_block_streamed_in_small_pieces_equals_parse():
    """A tool call that writes 100 KB, fed 4 characters at a time (the stream looks for the end tag in the new text
    and the tail before it only, and joins the block once it closes): the same call and content as parse."""
    text = 'Here: <tool_call>{"name": "f", "arguments": {"code": "' + "x = 1; " * 15000 + '"}}</tool_call> done'
    stream = tool_parsers.make_stream("hermes")
    pieces = [stream.feed(text[i:i + 4]) for i in range(0, len(text), 4)]
    rest, more = stream.finish()
    content, calls = tool_parsers.parse(text, "hermes")
    assert "".join(c for c, _ in pieces) + rest == content == "Here:  done"
    assert [c for _, found in pieces for c in found] + more == calls and len(calls) == 1


def test_required_tools_references_resolve_in_each_tools_own_parameters():
    """tool_choice "required" puts each tool's parameters inside one array-of-calls schema: its "#" and
    "#/properties/..." references kept pointing at that whole schema, so a recursive tool's arguments nested whole
    calls (accepted by the grammar) and a "#/properties/p" reference was a 400 (QA, 2026-12-07). They are rebased
    to where each tool's parameters sit; its $defs references still resolve at the top."""
    xgr = pytest.importorskip("xgrammar")
    from xgrammar.testing import _is_grammar_accept_string

    tree = {"type": "object", "properties": {"child": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
            "required": ["child"], "additionalProperties": False}
    alias = {"type": "object", "properties": {"p": {"type": "integer"}, "q": {"$ref": "#/properties/p"},
                                              "r": {"$ref": "#/$defs/R"}},
             "required": ["p", "q", "r"], "additionalProperties": False, "$defs": {"R": {"type": "boolean"}}}
    tools = [{"type": "function", "function": {"name": "a", "parameters": tree}},
             {"type": "function", "function": {"name": "b", "parameters": alias}}]
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], tools=tools, tool_choice="required")
    grammar = xgr.Grammar.from_json_schema(json.dumps(req.structured()["json"]))
    assert _is_grammar_accept_string(grammar, '[{"name": "a", "parameters": {"child": {"child": null}}}]')
    assert not _is_grammar_accept_string(grammar, '[{"name": "a", "parameters": {"child": [{"name": "a", '
                                                  '"parameters": {"child": null}}]}}]')
    assert _is_grammar_accept_string(grammar, '[{"name": "b", "parameters": {"p": 1, "q": 2, "r": true}}]')
    assert not _is_grammar_accept_string(grammar, '[{"name": "b", "parameters": {"p": 1, "q": "x", "r": true}}]')
