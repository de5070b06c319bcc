"""The soak's (``cadence/bench/soak/``) judging logic on synthetic data: RSS growth, request accounting,
the idle check.

No server: the soak itself is a benchmark, run by hand (``tests/bench/test_soak_run.py`` runs it
against a scripted server).
"""

from __future__ import annotations

import os
import random
from collections import Counter

import pytest

from cadence.bench.metrics import percentile
from cadence.bench.soak.load import MIX, PERSON_SCHEMA, Attempt, Spec, build_spec, max_prompt_words, parse_mix
from cadence.bench.soak.outcome import ABANDONED, COMPLETED, LOST, Outcome, account, classify
from cadence.bench.soak.probe import parse_metrics, parse_stat, parse_vmrss, process_tree_rss
from cadence.bench.soak.verdict import check_idle, judge_rss_growth, theil_sen_slope, verdict, warmup_seconds

MIB = 1024 * 1024


# ---- RSS growth -------------------------------------------------------------------------------


def _series(values: list[float], every_s: float = 2.0) -> list[tuple[float, float]]:
    return [(i * every_s, v) for i, v in enumerate(values)]


def test_warmup_is_a_fifth_at_least_a_minute_at_most_half() -> None:
    assert warmup_seconds(600) == 120  # 10 min: 20%
    assert warmup_seconds(180) == 60  # 3 min: the minute
    assert warmup_seconds(60) == 30  # 1 min: half


def test_flat_series_with_noise_passes() -> None:
    rng = random.Random(0)
    series = _series([400 * MIB + rng.uniform(-2, 2) * MIB for _ in range(300)])
    g = judge_rss_growth(series, warmup_end=120, end=600, limit=64 * MIB, process="api")
    assert g.judged and g.ok
    assert abs(g.growth) < 4 * MIB


def test_one_spike_is_not_growth() -> None:
    values = [400 * MIB] * 300
    values[-1] = values[-3] = 900 * MIB  # spikes in the last window
    values[61] = 100 * MIB  # and a dip in the first one
    g = judge_rss_growth(_series(values), warmup_end=120, end=600, limit=64 * MIB)
    assert g.ok and g.growth == 0


def test_steady_leak_fails() -> None:
    # 0.5 MiB per sample (2 s): 120 MiB over the 240 samples after the warm-up.
    series = _series([400 * MIB + i * MIB / 2 for i in range(300)])
    g = judge_rss_growth(series, warmup_end=120, end=600, limit=64 * MIB, process="core")
    assert g.judged and not g.ok
    assert 100 * MIB < g.growth < 125 * MIB
    assert theil_sen_slope(series) == pytest.approx(MIB / 4)  # bytes per second


def test_step_after_warmup_fails_but_growth_inside_warmup_does_not() -> None:
    during_warmup = [300 * MIB] * 30 + [500 * MIB] * 270  # grows at t = 60 s, warm-up ends at 120 s
    assert judge_rss_growth(_series(during_warmup), 120, 600, 64 * MIB).ok
    after_warmup = [300 * MIB] * 150 + [400 * MIB] * 150  # grows at t = 300 s
    g = judge_rss_growth(_series(after_warmup), 120, 600, 64 * MIB)
    assert not g.ok and g.growth == 100 * MIB


def test_growth_exactly_at_the_bound_passes() -> None:
    values = [300 * MIB] * 100 + [364 * MIB] * 100
    assert judge_rss_growth(_series(values), 0, 400, 64 * MIB).ok


def test_samples_after_the_end_of_load_are_ignored() -> None:
    values = [300 * MIB] * 100 + [900 * MIB] * 20  # the last 20 after end=198 s
    assert judge_rss_growth(_series(values), 0, 198, 64 * MIB).ok


def test_too_few_samples_are_not_judged() -> None:
    g = judge_rss_growth(_series([1.0, 1e12, 1e12]), 0, 100, 64 * MIB)
    assert not g.judged and g.ok and "not judged" in g.note
    short = judge_rss_growth(_series([300 * MIB] * 3 + [500 * MIB] * 3), 0, 100, 64 * MIB)
    assert short.judged and short.window == 3 and not short.ok


# ---- request accounting -------------------------------------------------------------------------


def _spec(kind: str = "chat", *, endpoint: str = "chat", n: int = 1, stream: bool = False,
          usage: bool = True, **extra: object) -> object:
    body: dict[str, object] = {"stream": stream}
    if stream and usage:
        body["stream_options"] = {"include_usage": True}
    return Spec(kind, endpoint, body, n=n, **extra)


def _chat_body(n: int, reason: str | None = "length", content: object = "hi", tokens: int = 5) -> dict:
    return {"choices": [{"index": i, "message": {"role": "assistant", "content": content}, "finish_reason": reason,
                         "logprobs": None} for i in range(n)],
            "usage": {"prompt_tokens": 3, "completion_tokens": tokens, "total_tokens": tokens + 3}}


def _chunk(index: int, text: str = "", reason: str | None = None, endpoint: str = "chat") -> dict:
    choice = {"index": index, "finish_reason": reason}
    choice.update({"delta": {"content": text}} if endpoint == "chat" else {"text": text})
    return {"choices": [choice]}


def _usage(tokens: int) -> dict:
    return {"choices": [], "usage": {"completion_tokens": tokens}}


def test_valid_bodies_complete() -> None:
    outcome = classify(_spec(n=2), Attempt(status=200, body=_chat_body(2, tokens=9), latency_s=1.5))
    assert (outcome.status, outcome.tokens, outcome.latency_s) == (COMPLETED, 9, 1.5)
    completion = {"choices": [{"index": 0, "text": "x", "finish_reason": "stop", "logprobs": {"tokens": ["x"]}}],
                  "usage": {"completion_tokens": 1}}
    spec = _spec("completion", endpoint="completion", logprobs=True)
    assert classify(spec, Attempt(status=200, body=completion)).status == COMPLETED


@pytest.mark.parametrize(("body", "reason"), [
    (_chat_body(1), "1 choices, expected 2"),
    (_chat_body(2, reason=None), "finish_reason None"),
    (_chat_body(2, reason="abort"), "finish_reason 'abort'"),
    (_chat_body(2, content=None), "no text"),
    ({**_chat_body(2), "usage": None}, "usage"),
    ({"choices": [{"index": 0, "message": {"content": "a"}, "finish_reason": "stop"}] * 2,
      "usage": {"completion_tokens": 2}}, "choice indices"),
    ([1, 2], "not a JSON object"),
])
def test_invalid_bodies_are_lost(body: object, reason: str) -> None:
    outcome = classify(_spec(n=2), Attempt(status=200, body=body))
    assert outcome.status == LOST and reason in outcome.reason


def test_errors_hangs_and_transport_failures_are_lost() -> None:
    spec = _spec()
    error = {"error": {"message": "boom", "type": "server_error", "param": None, "code": "internal_error"}}
    assert classify(spec, Attempt(status=500, body=error)).reason == "HTTP 500 (internal_error)"
    assert classify(spec, Attempt(status=503, body=None)).status == LOST
    assert classify(spec, Attempt(status=400, body=error)).status == LOST  # ours or theirs: lost
    assert classify(spec, Attempt(hung=True)).reason == "no end within the hang guard"
    lost = classify(spec, Attempt(error="ServerDisconnectedError: gone"))
    assert lost.status == LOST and "ServerDisconnectedError" in lost.reason


def test_abandoned_on_purpose_is_not_lost() -> None:
    spec = _spec("disconnect", stream=True, disconnect_after=2)
    attempt = Attempt(status=200, events=[_chunk(0, "a"), _chunk(0, "b")], abandoned="disconnected after 2")
    outcome = classify(spec, attempt)
    assert (outcome.status, outcome.tokens) == (ABANDONED, 2)
    cancel = classify(_spec("cancel", cancel_after_s=0.5), Attempt(abandoned="timed out on purpose"))
    assert cancel.status == ABANDONED


def test_a_valid_stream_completes() -> None:
    events = [_chunk(0, "a"), _chunk(1, "b"), _chunk(0, "c", "stop"), _chunk(1, "", "length"), _usage(7), "[DONE]"]
    outcome = classify(_spec(n=2, stream=True), Attempt(status=200, events=events))
    assert (outcome.status, outcome.tokens) == (COMPLETED, 7)
    # Without a usage chunk the tokens are the chunks that carried text.
    events = [_chunk(0, "a", endpoint="completion"), _chunk(0, "b", "stop", endpoint="completion"), "[DONE]"]
    spec = _spec(endpoint="completion", stream=True, usage=False)
    assert classify(spec, Attempt(status=200, events=events)).tokens == 2


@pytest.mark.parametrize(("events", "reason"), [
    ([_chunk(0, "a"), _chunk(0, "", "stop"), _usage(1)], "without [DONE]"),
    ([_chunk(0, "a"), _usage(1), "[DONE]"], "never got a finish_reason"),
    ([_chunk(0, "a"), {"error": {"code": "engine_dead", "message": "x"}}], "error event (engine_dead)"),
    ([_chunk(0, "a", "stop"), _chunk(0, "b"), _usage(2), "[DONE]"], "text after its finish_reason"),
    ([_chunk(3, "a", "stop"), _usage(1), "[DONE]"], "chunk for choice 3"),
    ([_chunk(0, "a", "error"), _usage(1), "[DONE]"], "finish_reason 'error'"),
    ([_chunk(0, "a", "stop"), "[DONE]"], "no usage chunk"),
    ([_chunk(0, "a", "stop"), _usage(1), "[DONE]", _chunk(0, "b")], "data after [DONE]"),
])
def test_broken_streams_are_lost(events: list, reason: str) -> None:
    outcome = classify(_spec(stream=True), Attempt(status=200, events=events))
    assert outcome.status == LOST and reason in outcome.reason


def test_structured_output_must_parse_when_it_stopped() -> None:
    spec = _spec("json", json_schema=PERSON_SCHEMA)
    good = _chat_body(1, reason="stop", content='{"name": "Ann", "age": 3, "city": "Oslo"}')
    assert classify(spec, Attempt(status=200, body=good)).status == COMPLETED
    truncated = _chat_body(1, reason="length", content='{"name": "An')  # cut by max_tokens: fine
    assert classify(spec, Attempt(status=200, body=truncated)).status == COMPLETED
    for content, reason in (('{"name": "An', "not JSON"), ('{"name": "Ann"}', "lacks ['age', 'city']")):
        outcome = classify(spec, Attempt(status=200, body=_chat_body(1, reason="stop", content=content)))
        assert outcome.status == LOST and reason in outcome.reason


def test_account_adds_up_by_kind() -> None:
    outcomes = [Outcome("chat", COMPLETED, "", 10, 1.0), Outcome("chat", LOST, "x", 0, 2.0),
                Outcome("cancel", ABANDONED, "t", 0, 0.3), Outcome("chat", COMPLETED, "", 5, 3.0)]
    table = account(outcomes)
    assert list(table) == ["chat", "cancel", "all"]
    chat, total = table["chat"], table["all"]
    assert (chat.sent, chat.completed, chat.abandoned, chat.lost, chat.tokens) == (3, 2, 0, 1, 15)
    assert (total.sent, total.completed, total.abandoned, total.lost) == (4, 2, 1, 1)
    assert sorted(total.latencies) == [1.0, 3.0]  # completed requests only
    for s in table.values():
        assert s.sent == s.completed + s.abandoned + s.lost


def test_percentile() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99


def test_every_kind_builds_a_request_that_says_what_to_expect() -> None:
    rng = random.Random(1)
    for _ in range(50):
        for kind, _weight in MIX:
            spec = build_spec(kind, rng, model="m", prefixes=["p " * 10], long_max=128,
                                   cancel_window=(1.0, 5.0))
            assert spec.kind == kind and spec.body["model"] == "m"
            assert ("messages" in spec.body) == (spec.endpoint == "chat") != ("prompt" in spec.body)
            assert spec.body.get("n", 1) == spec.n and 1 <= spec.body["max_tokens"] <= 128
            assert (spec.disconnect_after is not None) == (kind == "disconnect") and (
                kind != "disconnect" or spec.stream)
            assert (spec.cancel_after_s is not None) == (kind == "cancel")
            if kind == "cancel":
                assert not spec.stream and spec.body["ignore_eos"]
                assert 0 <= spec.cancel_after_s <= 0.1 or 1.2 <= spec.cancel_after_s <= 3.0
            if kind == "json":
                assert spec.body["response_format"]["json_schema"]["schema"] == PERSON_SCHEMA
            if kind == "shared-prefix":
                text = spec.body.get("prompt") or spec.body["messages"][-1]["content"]
                assert text.startswith("p p p")


# ---- the idle check and the verdict ---------------------------------------------------------------

_METRICS = """\
# HELP cadence:num_requests_running Requests in the engine's running batch.
# TYPE cadence:num_requests_running gauge
cadence:num_requests_running{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0
cadence:num_requests_waiting{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0
cadence:num_requests_pending{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0
cadence:kv_cache_usage_perc{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0
cadence:kv_cache_num_blocks{engine="0",model_name="SmolLM2-135M-Instruct"} 2911.0
cadence:kv_cache_free_blocks{engine="0",model_name="SmolLM2-135M-Instruct"} 2911.0
cadence:generation_tokens_total{model_name="SmolLM2-135M-Instruct"} 1234.0
cadence:request_success_total{finished_reason="abort",model_name="SmolLM2-135M-Instruct"} 7.0
cadence:e2e_request_latency_seconds_bucket{le="0.3",model_name="SmolLM2-135M-Instruct"} 2.0
"""


def test_parse_metrics_keys_by_labels_without_the_model() -> None:
    m = parse_metrics(_METRICS)
    assert m["cadence:kv_cache_num_blocks"] == {"engine=0": 2911.0}
    assert m["cadence:generation_tokens_total"] == {"": 1234.0}
    assert m["cadence:request_success_total"] == {"finished_reason=abort": 7.0}
    assert m["cadence:e2e_request_latency_seconds_bucket"] == {"le=0.3": 2.0}
    assert "# HELP" not in str(m)


def test_idle_engine_passes_with_cached_blocks_counted_free() -> None:
    assert check_idle(parse_metrics(_METRICS)) == []


@pytest.mark.parametrize(("old", "new", "reason"), [
    ('running{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0', 'running{engine="0"} 2.0',
     "num_requests_running = 2 (engine=0)"),
    ('pending{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0', 'pending{engine="0"} 1.0',
     "num_requests_pending = 1"),
    ('usage_perc{engine="0",model_name="SmolLM2-135M-Instruct"} 0.0', 'usage_perc{engine="0"} 0.0103',
     "kv_cache_usage_perc = 0.0103"),
    ('free_blocks{engine="0",model_name="SmolLM2-135M-Instruct"} 2911.0', 'free_blocks{engine="0"} 2881.0',
     "30 of 2911 KV blocks not free"),
])
def test_busy_or_leaking_engine_is_not_idle(old: str, new: str, reason: str) -> None:
    text = _METRICS.replace(old, new)
    assert text != _METRICS
    problems = check_idle(parse_metrics(text))
    assert any(reason in p for p in problems), problems


def test_idle_checks_every_engine_and_needs_the_metrics() -> None:
    text = _METRICS + 'cadence:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n'
    assert check_idle(parse_metrics(text)) == ["kv_cache_usage_perc = 0.5000 (engine=1)"]
    assert check_idle({}) == ["no cadence:kv_cache_usage_perc in /metrics"]


def test_verdict_collects_every_failure() -> None:
    ok = account([Outcome("chat", COMPLETED, "", 1, 1.0)])
    flat = judge_rss_growth(_series([1.0] * 20), 0, 100, 64 * MIB, process="api (1)")
    assert verdict([flat], ok, Counter(), [], []) == []
    grown = judge_rss_growth(_series([0.0] * 10 + [100 * MIB] * 10), 0, 100, 64 * MIB, process="core (2)")
    lost = account([Outcome("chat", LOST, "HTTP 500 (x)", 0, 1.0)])
    failures = verdict([flat, grown], lost, Counter({"HTTP 500 (x)": 1}), ["kv_cache_usage_perc = 0.1"],
                            ["the server exited"])
    assert len(failures) == 4
    assert failures[0].startswith("RSS of core (2) grew 100.0 MiB")
    assert "1 of 1 requests lost: 1x HTTP 500 (x)" in failures[1]
    assert "not idle" in failures[2] and failures[3] == "the server exited"
    assert verdict([], account([]), Counter(), [], []) == ["no request was sent"]


# ---- /proc parsing --------------------------------------------------------------------------------


def test_proc_parsers() -> None:
    assert parse_vmrss("Name:\tpython\nVmPeak:\t 10 kB\nVmRSS:\t  386344 kB\n") == 386344 * 1024
    assert parse_vmrss("Name:\tkthreadd\n") is None
    assert parse_stat("4242 (cadence-core-0) S 4100 4242 1 0 -1") == ("cadence-core-0", 4100)
    assert parse_stat("7 (a (b) c) R 1 7 7 0") == ("a (b) c", 1)


def test_process_tree_of_this_process() -> None:
    rss = process_tree_rss(os.getpid())
    assert any(name.startswith("api (") and value > 0 for name, value in rss.items())


def test_mix_reweighs_kinds() -> None:
    assert parse_mix(None) == MIX
    mix = dict(parse_mix("disconnect=40, cancel=0"))
    assert mix["disconnect"] == 40 and "cancel" not in mix and mix["chat"] == dict(MIX)["chat"]
    for bad in ("nope=3", "chat=x", ",".join(f"{k}=0" for k, _ in MIX)):
        with pytest.raises(ValueError, match="--mix"):
            parse_mix(bad)


def test_prompts_fit_the_context() -> None:
    assert max_prompt_words(None, 256) == 4000
    assert max_prompt_words(8192, 256) == 4000
    assert max_prompt_words(2048, 256) == 1152  # (2048 - 256 - 64) / 1.5
    rng = random.Random(2)
    for _ in range(200):
        for kind, _weight in MIX:
            spec = build_spec(kind, rng, model=None, prefixes=["p"], long_max=64, cancel_window=(1.0, 5.0),
                                   max_words=100)
            assert "model" not in spec.body
            text = spec.body.get("prompt") or " ".join(m["content"] for m in spec.body["messages"])
            assert len(text.split()) <= 100 + 15 + 20  # a system message, a shared prefix's question
