"""Tool-call parsers (``cadence/api/tool_parsers``): for each format, recorded outputs with their exact
parse; the same result streamed however the text is cut (at every character boundary, a character at
a time, in seeded random pieces) with names always whole; what a stream sends at once and what it
holds back; the shared scanners; and finding the parsers through their entry points."""

from __future__ import annotations

import random
from importlib.metadata import EntryPoint

import pytest

import cadence.plugins as plugins
from cadence.api import tool_parsers
from cadence.api.markers import partial_marker
from cadence.api.tool_parsers import (
    FunctionCall,
    ParsedMessage,
    ToolParser,
    installed_tool_parsers,
    load_tool_parser,
)
from cadence.api.tool_parsers import loader as tool_parser_loader
from cadence.api.tool_parsers.hermes import HermesToolParser
from cadence.api.tool_parsers.json_call import JsonObjectScan, object_members, read_call
from cadence.api.tool_parsers.llama3_json import Llama3JsonToolParser
from cadence.api.tool_parsers.markup_stream import skip_space
from cadence.api.tool_parsers.mistral import MistralToolParser
from cadence.api.tool_parsers.pythonic import CallListScan, PythonicToolParser, read_calls

WEATHER = FunctionCall("get_weather", '{"city": "Paris", "unit": "celsius"}')
TIME = FunctionCall("get_time", '{"timezone": "Europe/Paris"}')
# Braces, brackets, quotes, escapes, another format's markup and unicode inside strings, nested objects.
TRICKY_ARGS = ('{"path": "a}b].txt", "text": "say \\"hi\\" {x} [TOOL_CALLS] </tool_call> \\\\ \\u00e9 é🙂",'
               ' "meta": {"tags": ["x", {"y": null}], "n": -1.5e3}}')
TRICKY = FunctionCall("write_file", TRICKY_ARGS)


def message(content: str | None, *calls: FunctionCall) -> ParsedMessage:
    return ParsedMessage(content, list(calls))


def as_content(text: str) -> tuple[str, ParsedMessage]:
    """A recorded text that has no call: all of it is content."""
    return text, message(text)


HERMES = {
    "content only": as_content("The capital of France is Paris."),
    "only whitespace": (" \n\n ", message(None)),
    "one call": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                 '</tool_call>', message(None, WEATHER)),
    "two parallel calls": ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
                           '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": '
                           '{"timezone": "Europe/Paris"}}\n</tool_call>', message(None, WEATHER, TIME)),
    "content then a call": ('Let me check the weather.\n<tool_call>\n{"name": "get_weather", "arguments": '
                            '{"city": "Paris", "unit": "celsius"}}\n</tool_call>',
                            message("Let me check the weather.\n", WEATHER)),
    "tricky arguments": (f'<tool_call>\n{{"name": "write_file", "arguments": {TRICKY_ARGS}}}\n</tool_call>',
                         message(None, TRICKY)),
    "arguments before the name, no arguments": (
        '<tool_call>{"arguments":  { "q" : [1, 2] } , "name": "search"}</tool_call>'
        '<tool_call>{"name": "get_time"}</tool_call>',
        message(None, FunctionCall("search", '{ "q" : [1, 2] }'), FunctionCall("get_time", "{}"))),
    "invalid JSON": as_content('<tool_call>\n{"name": "f", "arguments": {"a": }}\n</tool_call>'),
    "not JSON at all": as_content("<tool_call>\n{name: f}\n</tool_call> ok"),
    "not a call object": as_content('<tool_call>["get_time"]</tool_call>'),
    "arguments not an object": as_content('<tool_call>{"name": "f", "arguments": "{}"}</tool_call>'),
    "truncated in the arguments": as_content('Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"ci'),
    "unclosed but whole": ('<tool_call>\n{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}\n</tool_',
                           message("\n</tool_", TIME)),
    "truncated marker": as_content("Answer: 42 <tool_"),
    "a call then content": ('<tool_call>{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}</tool_call>'
                            " Done: a < b <toolbox>", message(" Done: a < b <toolbox>", TIME)),
}

LLAMA3_JSON = {
    "content only": as_content("Paris is the capital of France."),
    "one call": ('{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}', message(None, WEATHER)),
    "python tag and arguments": ('<|python_tag|>{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}',
                                 message(None, TIME)),
    "two calls": ('\n{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}} ;\n'
                  '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}\n', message(None, WEATHER, TIME)),
    "tricky arguments": (f'{{"name": "write_file", "parameters": {TRICKY_ARGS}}}', message(None, TRICKY)),
    "content then JSON": as_content('Here it is: {"name": "get_time", "parameters": {}}'),
    "an answer in JSON": as_content('{"answer": 42, "unit": "km"}'),
    "invalid JSON": as_content('{"name": "f", "parameters": {"a": 1,}}'),
    "both argument keys": as_content('{"name": "f", "parameters": {}, "arguments": {}}'),
    "truncated": as_content('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Pa'),
    "truncated tag": as_content("<|python_ta"),
    "a call then content": ('{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}} and that is all',
                            message(" and that is all", TIME)),
    "a call then an invalid one": ('{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}; {"oops": 1}',
                                   message('; {"oops": 1}', TIME)),
}

MISTRAL = {
    "content only": as_content("Bonjour! [1] and [TOOL] are not calls."),
    "array, one call": ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}]',
                        message(None, WEATHER)),
    "array, two calls": ('Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
                         ', {"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}]',
                         message("Sure.", WEATHER, TIME)),
    "array, tricky arguments": (f'[TOOL_CALLS][{{"name": "write_file", "arguments": {TRICKY_ARGS}}}]',
                                message(None, TRICKY)),
    "name form, two calls": ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius"}'
                             '[TOOL_CALLS]get_time[ARGS]{"timezone": "Europe/Paris"}', message(None, WEATHER, TIME)),
    "name form without [ARGS]": (f"Writing.[TOOL_CALLS]write_file{TRICKY_ARGS}", message("Writing.", TRICKY)),
    "invalid JSON": as_content('[TOOL_CALLS][{"name": "f", "arguments": {"a": tru}}]'),
    "invalid name": as_content("[TOOL_CALLS]get weather[ARGS]{}"),
    "name form, arguments not an object": as_content("[TOOL_CALLS]f[ARGS][1]"),
    "truncated arguments": as_content('Let me look.[TOOL_CALLS]get_weather[ARGS]{"city": "Pa'),
    "truncated name": as_content("[TOOL_CALLS]get_wea"),
    "truncated marker": as_content("One moment [TOOL_C"),
    "unclosed array": ('[TOOL_CALLS][{"name": "get_time", "arguments": {"timezone": "Europe/Paris"}}, ',
                       message(", ", TIME)),
}

PYTHONIC = {
    "content only": as_content("It is sunny in Paris (mostly)."),
    "one call": ("[get_weather(city=\"Paris\", unit='celsius')]", message(None, WEATHER)),
    "two calls, nested literals": (
        '\n[search(query="a, b", limit=-3, filters={"lang": ["en", "fr"], "safe": True}, ratio=+0.5),'
        " get_time ( ) ]\n",
        message(None, FunctionCall("search", '{"query": "a, b", "limit": -3, "filters": {"lang": ["en", "fr"], '
                                              '"safe": true}, "ratio": 0.5}'), FunctionCall("get_time", "{}"))),
    "strings with brackets, quotes, escapes, unicode": (
        "[note(text='it\\'s ) ] [ \"quoted\" \\u00e9 🙂', pair=(1, None))]",
        message(None, FunctionCall("note", '{"text": "it\'s ) ] [ \\"quoted\\" é 🙂", "pair": [1, null]}'))),
    "not calls": as_content("[1, 2, 3] are numbers"),
    "prose in brackets": as_content("[Note: this is prose (really)]"),
    "empty list": as_content("[]"),
    "a name that is not a literal": as_content("[get_weather(city=paris)]"),
    "a positional argument": as_content('[get_weather("Paris")]'),
    "a dotted name": as_content("[math.sqrt(x=2)]"),
    "not JSON numbers": as_content("[f(a=1e999)]"),
    "content first": as_content("Sure: [get_time()]"),
    "truncated": as_content('[get_weather(city="Par'),
    "a list then content": ("[get_time(timezone='Europe/Paris')]\nDone.", message("\nDone.", TIME)),
}

PARSERS: dict[str, tuple[type[ToolParser], dict[str, tuple[str, ParsedMessage]]]] = {
    "hermes": (HermesToolParser, HERMES), "llama3_json": (Llama3JsonToolParser, LLAMA3_JSON),
    "mistral": (MistralToolParser, MISTRAL), "pythonic": (PythonicToolParser, PYTHONIC),
}
RECORDED = [pytest.param(cls(), text, expected, id=f"{name}: {case}")
            for name, (cls, cases) in PARSERS.items() for case, (text, expected) in cases.items()]


def streamed(parser: ToolParser, pieces: list[str]) -> ParsedMessage:
    """Feed ``pieces`` to a fresh stream and join the deltas, checking how calls are sent: in order, the
    name on a call's first delta and never after it."""
    stream = parser.stream()
    content, names, arguments = "", [], []
    for delta in [*(stream.feed(piece) for piece in pieces), stream.finish()]:
        content += delta.content
        for part in delta.tool_calls:
            if part.index == len(names):
                assert part.name, f"call {part.index} began without its name"
                names.append(part.name)
                arguments.append("")
            else:
                assert part.index < len(names) and part.name is None, part
            arguments[part.index] += part.arguments
    calls = [FunctionCall(name, args) for name, args in zip(names, arguments, strict=True)]
    return ParsedMessage(content or None, calls)


@pytest.mark.parametrize(("parser", "text", "expected"), RECORDED)
def test_parse(parser: ToolParser, text: str, expected: ParsedMessage) -> None:
    assert parser.parse(text) == expected


@pytest.mark.parametrize(("parser", "text", "expected"), RECORDED)
def test_streamed_in_two_pieces_at_every_boundary(parser: ToolParser, text: str, expected: ParsedMessage) -> None:
    for cut in range(len(text) + 1):
        assert streamed(parser, [text[:cut], text[cut:]]) == expected, f"cut at {cut}"


@pytest.mark.parametrize(("parser", "text", "expected"), RECORDED)
def test_streamed_a_character_at_a_time(parser: ToolParser, text: str, expected: ParsedMessage) -> None:
    assert streamed(parser, list(text)) == expected


@pytest.mark.parametrize(("parser", "text", "expected"), RECORDED)
def test_streamed_in_random_pieces(parser: ToolParser, text: str, expected: ParsedMessage) -> None:
    rng = random.Random(17)
    for _ in range(20):
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randint(2, 8))))
        pieces = [text[start:end] for start, end in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        assert streamed(parser, pieces) == expected, pieces


def feeds(parser: ToolParser, *pieces: str) -> list[tuple[str, list[tuple[int, str | None, str]]]]:
    """What each ``feed`` of ``pieces`` returns, then ``finish``: (content, [(index, name, arguments)])."""
    stream = parser.stream()
    deltas = [*(stream.feed(piece) for piece in pieces), stream.finish()]
    return [(d.content, [(c.index, c.name, c.arguments) for c in d.tool_calls]) for d in deltas]


def test_hermes_sends_content_at_once_and_a_call_when_its_object_closes() -> None:
    assert feeds(HermesToolParser(), "Hi <tool", "_call>\n", '{"name": "f", "arguments": {"a": 1}', "}",
                 "\n</tool_call>", " <toolbox>") == [
        ("Hi ", []), ("", []), ("", []), ("", [(0, "f", '{"a": 1}')]), ("", []), (" <toolbox>", []), ("", [])]


def test_llama3_json_sends_content_at_once_unless_it_may_be_a_call() -> None:
    assert feeds(Llama3JsonToolParser(), "Hello", " {") == [("Hello", []), (" {", []), ("", [])]
    assert feeds(Llama3JsonToolParser(), "<|python", "_tag|>{", '"name": "f"}', "; ") == [
        ("", []), ("", []), ("", [(0, "f", "{}")]), ("", []), ("; ", [])]


def test_mistral_holds_back_only_a_prefix_of_its_marker() -> None:
    assert feeds(MistralToolParser(), "ok [TOOL", "S] [TOOL_CALLS]f", "[AR", 'GS]{"a": ', "2}", " bye") == [
        ("ok ", []), ("[TOOLS] ", []), ("", []), ("", []), ("", [(0, "f", '{"a": 2}')]), (" bye", []), ("", [])]


def test_pythonic_gives_up_on_a_list_as_soon_as_it_cannot_be_calls() -> None:
    assert feeds(PythonicToolParser(), "[Note", ": more", "]") == [("", []), ("[Note: more", []), ("]", []), ("", [])]
    assert feeds(PythonicToolParser(), "[f(a='])')", ", g()", "]") == [
        ("", []), ("", []), ("", [(0, "f", '{"a": "])"}'), (1, "g", "{}")]), ("", [])]


def test_whitespace_is_held_until_real_content_comes() -> None:
    assert feeds(HermesToolParser(), "\n", " ", "Hi", "\n") == [("", []), ("", []), ("\n Hi", []), ("\n", []),
                                                               ("", [])]
    assert feeds(HermesToolParser(), "\n", '<tool_call>{"name": "f"}</tool_call>', "\n") == [
        ("", []), ("", [(0, "f", "{}")]), ("", []), ("", [])]


def test_only_mistral_needs_special_tokens() -> None:
    assert {name: cls.needs_special_tokens for name, (cls, _) in PARSERS.items()} == {
        "hermes": False, "llama3_json": False, "mistral": True, "pythonic": False}


def test_skip_space_stops_at_the_first_character_json_does_not_skip() -> None:
    assert skip_space(" \t\r\n{x", 0) == 4
    assert skip_space("ab  ", 2) == 4
    assert skip_space("\u00a0{", 0) == 0  # not JSON whitespace


def test_partial_marker() -> None:
    assert partial_marker("Hi <tool_c", "<tool_call>") == 7
    assert partial_marker("<tool_call", "<tool_call>") == 10
    assert partial_marker("a <", "<tool_call>") == 1
    assert partial_marker("Hi", "<tool_call>") == 0
    assert partial_marker("", "<tool_call>") == 0


def test_json_object_scan_follows_strings_and_escapes_across_pieces() -> None:
    text = 'x{"a": "}\\"{", "b": [{}]} tail'
    scan = JsonObjectScan(1)
    assert [scan.advance(text[:n]) for n in (5, 11, 20, len(text))] == [None, None, None, 25]
    assert text[1:25] == '{"a": "}\\"{", "b": [{}]}'
    broken = JsonObjectScan(0)
    assert broken.advance('{"a": 1, oops}') is None and broken.broken and broken.position == 9


def test_object_members_keep_each_value_as_written() -> None:
    assert object_members('{ "a" : {"x": [1, 2]} , "b":"s" }') == {"a": ({"x": [1, 2]}, '{"x": [1, 2]}'),
                                                                    "b": ("s", '"s"')}
    assert object_members("{}") == {}
    for bad in ('{"a": 1,}', '{"a" 1}', '{"a": NaN}', '{1: 2}', '{"a": 1} {}', '["a"]', '{"a": 1'):
        assert object_members(bad) is None, bad


def test_read_call() -> None:
    assert read_call('{"arguments": {"a": 1}, "name": "f"}', ("arguments",)) == FunctionCall("f", '{"a": 1}')
    assert read_call('{"name": "f"}', ("arguments",)) == FunctionCall("f", "{}")
    # A key the format does not have (arguments under another name) is not a call without arguments.
    for bad in ('{"name": "", "arguments": {}}', '{"name": 1, "arguments": {}}', '{"arguments": {}}',
                '{"name": "f", "arguments": [1]}', '{"name": "f", "parameters": {"a": 1}}',
                '{"name": "f", "arguments": {}, "id": "x"}'):
        assert read_call(bad, ("arguments",)) is None, bad


def test_call_list_scan_and_read_calls() -> None:
    scan = CallListScan(0)
    assert scan.advance("[f(a=')]'), g (b=\"\\\"\")") is None and not scan.broken
    assert scan.advance("[f(a=')]'), g (b=\"\\\"\")] x") == 23
    assert read_calls("[f(a=')]'), g (b=\"\\\"\")]") == [FunctionCall("f", '{"a": ")]"}'),
                                                         FunctionCall("g", '{"b": "\\""}')]
    for bad in ("[f(**kw)]", "[f(a={1: 2})]", "[f(a=-'x')]", "[f(a=b'x')]", "[f(a=1j)]", "[f(a={*x})]", "(f(),)"):
        assert read_calls(bad) is None, bad


def test_the_built_in_parsers_are_installed_and_load_by_name() -> None:
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(installed_tool_parsers())
    for name, (cls, _) in PARSERS.items():
        parser = load_tool_parser(name)
        assert type(parser) is cls and parser.name == name


def test_an_unknown_name_lists_the_installed_parsers() -> None:
    with pytest.raises(ValueError) as raised:
        load_tool_parser("nope")
    installed = ", ".join(installed_tool_parsers())
    assert str(raised.value) == f"unknown tool parser 'nope'; installed tool parsers: {installed}"


def test_a_broken_or_wrong_plugin_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    group = tool_parser_loader.GROUP
    entries = [EntryPoint("broken", "cadence_no_such_module:Parser", group),
               EntryPoint("wrong", "cadence.api.tool_parsers.base:FunctionCall", group)]
    monkeypatch.setattr(plugins, "entry_points", lambda group: entries)
    with pytest.raises(ValueError, match=r"^tool parser 'broken' \(cadence_no_such_module:Parser\) failed to import: "):
        load_tool_parser("broken")
    with pytest.raises(TypeError, match=r"^entry point 'wrong' in cadence\.tool_parsers must name a ToolParser "):
        load_tool_parser("wrong")


def test_the_package_exports_the_contract() -> None:
    assert tool_parsers.collect([]) == message(None)


def test_a_mistral_name_longer_than_openai_allows_is_content() -> None:
    """64 characters at most: a run past it is content at once, and no piece rescans more than that."""
    parser = MistralToolParser()
    longest = "f" * 64
    assert parser.parse(f"[TOOL_CALLS]{longest}[ARGS]{{}}").tool_calls == [FunctionCall(longest, "{}")]
    too_long = f"[TOOL_CALLS]{longest}g[ARGS]{{}}"
    assert parser.parse(too_long) == ParsedMessage(too_long, [])
