"""The reasoning parsers: exact splits of recorded outputs, streams that agree with them however
the text is cut, and finding parsers by name."""

from __future__ import annotations

import itertools
import random
from importlib.metadata import EntryPoint

import pytest

import cadence.plugins as plugins
from cadence.api.markers import partial_marker
from cadence.api.reasoning_parsers import (
    ReasoningDelta,
    ReasoningParser,
    ReasoningSplit,
    installed_reasoning_parsers,
    load_reasoning_parser,
)
from cadence.api.reasoning_parsers import loader as loader_module
from cadence.api.reasoning_parsers.think import (
    END,
    DeepSeekR1ReasoningParser,
    Qwen3ReasoningParser,
)

QWEN3 = Qwen3ReasoningParser()
DEEPSEEK_R1 = DeepSeekR1ReasoningParser()

# (text, qwen3's split, deepseek_r1's split) as (reasoning, content).
RECORDED: list[tuple[str, tuple[str | None, str | None], tuple[str | None, str | None]]] = [
    ("", (None, None), (None, None)),
    ("The answer is 4.", (None, "The answer is 4."), ("The answer is 4.", None)),
    # Qwen3 with thinking on: the think block, then the answer (newlines kept, as vLLM keeps them).
    ("<think>\n2+2 is 4.\n</think>\n\nThe answer is 4.",
     ("\n2+2 is 4.\n", "\n\nThe answer is 4."), ("\n2+2 is 4.\n", "\n\nThe answer is 4.")),
    # DeepSeek-R1: its template opened the think block in the prompt.
    ("2+2 is 4.\n</think>\n\nThe answer is 4.",
     (None, "2+2 is 4.\n</think>\n\nThe answer is 4."), ("2+2 is 4.\n", "\n\nThe answer is 4.")),
    ("<think>\nchecking\n</think>", ("\nchecking\n", None), ("\nchecking\n", None)),
    ("checking\n</think>", (None, "checking\n</think>"), ("checking\n", None)),
    # Cut short by max_tokens inside the reasoning, or inside its closing marker.
    ("<think>\nstill thinking", ("\nstill thinking", None), ("\nstill thinking", None)),
    ("<think>so far</thi", ("so far</thi", None), ("so far</thi", None)),
    ("<think", (None, "<think"), ("<think", None)),
    ("<think></think>Hi", (None, "Hi"), (None, "Hi")),
    ("</think>Hi", (None, "</think>Hi"), (None, "Hi")),
    # "<" and "</" that are no marker, and markers after the first "</think>", are plain text.
    ("<think>a < b, </b> and <thin</think>x <think> y </think>",
     ("a < b, </b> and <thin", "x <think> y </think>"), ("a < b, </b> and <thin", "x <think> y </think>")),
    ("if a<b: return </div>", (None, "if a<b: return </div>"), ("if a<b: return </div>", None)),
    ("<think><think>x</think>y", ("<think>x", "y"), ("<think>x", "y")),
    # Only an opening marker at the very start opens the reasoning.
    (" <think>x</think>y", (None, " <think>x</think>y"), (" <think>x", "y")),
    ("<think>考虑一下 🤔 — ça</think>答案是 4 ✓",
     ("考虑一下 🤔 — ça", "答案是 4 ✓"), ("考虑一下 🤔 — ça", "答案是 4 ✓")),
    ("ünïcödé < 🤔 </ 答案", (None, "ünïcödé < 🤔 </ 答案"), ("ünïcödé < 🤔 </ 答案", None)),
]
TEXTS = [text for text, _, _ in RECORDED]
PARSERS = [QWEN3, DEEPSEEK_R1]


def streamed(parser: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    """Feed ``pieces`` to a fresh stream and finish it; the joined (reasoning, content) deltas.

    After each piece the stream may hold back only what could still be the start of a marker.
    """
    stream = parser.stream()
    deltas: list[ReasoningDelta] = []
    fed = ""
    for piece in pieces:
        fed += piece
        deltas.append(stream.feed(piece))
        whole = parser.split(fed)
        released = sum(len(d.reasoning) + len(d.content) for d in deltas)
        assert 0 <= len(whole.reasoning or "") + len(whole.content or "") - released < len(END)
    deltas.append(stream.finish())
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


def random_pieces(rng: random.Random, text: str, most_cuts: int) -> list[str]:
    """``text`` cut at up to ``most_cuts`` distinct random places (a cut at either end leaves an empty piece)."""
    cuts = sorted(rng.sample(range(len(text) + 1), rng.randint(0, min(len(text) + 1, most_cuts))))
    return [text[a:b] for a, b in itertools.pairwise([0, *cuts, len(text)])]


def assert_agrees(parser: ReasoningParser, text: str, pieces: list[str]) -> None:
    assert "".join(pieces) == text
    whole = parser.split(text)
    assert streamed(parser, pieces) == (whole.reasoning or "", whole.content or ""), pieces


@pytest.mark.parametrize(("text", "qwen3", "deepseek_r1"), RECORDED)
def test_recorded_outputs_split_exactly(text: str, qwen3: tuple[str | None, str | None],
                                        deepseek_r1: tuple[str | None, str | None]) -> None:
    assert QWEN3.split(text) == ReasoningSplit(*qwen3)
    assert DEEPSEEK_R1.split(text) == ReasoningSplit(*deepseek_r1)


def test_markers_split_across_tokens_are_held_back_then_resolved() -> None:
    tokens = ["<", "think", ">\n", "2+2", " <", "b", "</", "think", ">\n\n", "4", "</think>"]
    stream = QWEN3.stream()
    assert [stream.feed(token) for token in tokens] + [stream.finish()] == [
        ReasoningDelta("", ""), ReasoningDelta("", ""), ReasoningDelta("\n", ""), ReasoningDelta("2+2", ""),
        ReasoningDelta(" ", ""), ReasoningDelta("<b", ""), ReasoningDelta("", ""), ReasoningDelta("", ""),
        ReasoningDelta("", "\n\n"), ReasoningDelta("", "4"), ReasoningDelta("", "</think>"), ReasoningDelta("", ""),
    ]
    assert QWEN3.split("".join(tokens)) == ReasoningSplit("\n2+2 <b", "\n\n4</think>")


def test_a_held_back_start_is_released_by_finish() -> None:
    qwen3, deepseek_r1 = QWEN3.stream(), DEEPSEEK_R1.stream()
    assert (qwen3.feed("<thi"), deepseek_r1.feed("<thi")) == (ReasoningDelta("", ""), ReasoningDelta("", ""))
    assert (qwen3.finish(), deepseek_r1.finish()) == (ReasoningDelta("", "<thi"), ReasoningDelta("<thi", ""))
    reasoning = DEEPSEEK_R1.stream()
    assert reasoning.feed("thinking </thi") == ReasoningDelta("thinking ", "")
    assert reasoning.finish() == ReasoningDelta("</thi", "")


def test_a_no_thinking_qwen3_stream_is_content_from_the_first_character() -> None:
    stream = QWEN3.stream()
    assert stream.feed("H") == ReasoningDelta("", "H")
    assert stream.feed("i </think>") == ReasoningDelta("", "i </think>")


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@pytest.mark.parametrize("text", TEXTS)
def test_every_two_piece_cut_agrees_with_split(parser: ReasoningParser, text: str) -> None:
    for cut in range(len(text) + 1):
        assert_agrees(parser, text, [text[:cut], text[cut:]])


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@pytest.mark.parametrize("text", TEXTS)
def test_one_character_at_a_time_agrees_with_split(parser: ReasoningParser, text: str) -> None:
    assert_agrees(parser, text, list(text))


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@pytest.mark.parametrize("seed", range(20))
def test_random_cuts_agree_with_split(parser: ReasoningParser, seed: int) -> None:
    rng = random.Random(seed)
    for text in TEXTS:
        assert_agrees(parser, text, random_pieces(rng, text, 6))


@pytest.mark.parametrize("parser", PARSERS, ids=lambda p: p.name)
@pytest.mark.parametrize("seed", range(20))
def test_random_texts_of_marker_fragments_agree_with_split(parser: ReasoningParser, seed: int) -> None:
    rng = random.Random(seed)
    fragments = ["<think>", "</think>", "<", "</", "<th", "</thi", "think", ">", "x", "\n", "é", "🤔"]
    text = "".join(rng.choice(fragments) for _ in range(rng.randint(0, 12)))
    for _ in range(10):
        assert_agrees(parser, text, random_pieces(rng, text, 8))


@pytest.mark.parametrize(("text", "size"), [("", 0), ("abc", 0), ("abc<", 1), ("abc</thi", 5), ("</think", 7),
                                            ("</think>", 0), ("x</", 2), ("<<", 1)])
def test_partial_marker_of_the_end_marker(text: str, size: int) -> None:
    assert partial_marker(text, END) == size


def test_both_parsers_are_installed() -> None:
    assert {"qwen3", "deepseek_r1"} <= set(installed_reasoning_parsers())


@pytest.mark.parametrize(("name", "cls"), [("qwen3", Qwen3ReasoningParser),
                                           ("deepseek_r1", DeepSeekR1ReasoningParser)])
def test_each_name_loads_its_parser(name: str, cls: type[ReasoningParser]) -> None:
    parser = load_reasoning_parser(name)
    assert type(parser) is cls
    assert parser.name == name


def test_an_unknown_name_lists_the_installed_parsers() -> None:
    with pytest.raises(ValueError, match=r"^unknown reasoning parser 'granite'; installed reasoning parsers: "
                                         r"deepseek_r1, qwen3$"):
        load_reasoning_parser("granite")


def _only(monkeypatch: pytest.MonkeyPatch, name: str, value: str) -> None:
    """Make the entry-point group hold just ``name = value``."""
    point = EntryPoint(name, value, loader_module.GROUP)
    monkeypatch.setattr(plugins, "entry_points", lambda group: [point] if group == loader_module.GROUP else [])


def test_a_plugin_that_fails_to_import_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    _only(monkeypatch, "broken", "cadence_no_such_module:Parser")
    with pytest.raises(ValueError, match=r"^reasoning parser 'broken' \(cadence_no_such_module:Parser\) failed "
                                         r"to import: No module named 'cadence_no_such_module'$"):
        load_reasoning_parser("broken")


def test_a_plugin_that_is_not_a_parser_class_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    _only(monkeypatch, "marker", "cadence.api.reasoning_parsers.think:END")
    with pytest.raises(TypeError, match=r"^entry point 'marker' in cadence.reasoning_parsers must name a "
                                        r"ReasoningParser subclass, got '</think>'$"):
        load_reasoning_parser("marker")
