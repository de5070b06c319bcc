"""``GET /metrics`` (``cadence/api/metrics.py``): the Prometheus text after requests recorded through
:class:`RequestTimer` (a finished, an aborted and an errored one), and the engine cores' state read
at scrape time from :class:`EngineState`, one series per core; then the same through the app."""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families
from support.scripted_engine import Call, ScriptedEngine, post_json

from cadence.api.metrics import APIMetrics, EngineState, RequestTimer
from cadence.messages import CompletionOutput, RequestOutput, SchedulerStats

Labels = tuple[tuple[str, str], ...]
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens"]
ENGINE_GAUGES = ["num_requests_running", "num_requests_waiting", "num_requests_pending", "kv_cache_usage_perc",
                 "kv_cache_num_blocks", "kv_cache_free_blocks", "scheduling_policy_info"]
ENGINE_COUNTERS = ["prefix_cache_queries", "prefix_cache_hits", "num_preemptions", "engine_steps",
                   "engine_step_seconds", "model_forward_seconds"]
# The token histograms' buckets for a context of 64: 1, 2, 5 per decade up to it.
TOKEN_BUCKETS = ["1.0", "2.0", "5.0", "10.0", "20.0", "50.0", "+Inf"]


def parse(text: bytes | str) -> tuple[dict[str, str], dict[tuple[str, Labels], float]]:
    """Each family's type, and each sample's value by (name, sorted labels); ``_created`` left out
    (whether it is there is a process-wide switch of prometheus_client)."""
    types: dict[str, str] = {}
    samples: dict[tuple[str, Labels], float] = {}
    raw = text.decode() if isinstance(text, bytes) else text
    for family in text_string_to_metric_families(raw):
        if family.name.endswith("_created"):
            continue
        types[family.name] = family.type
        for sample in family.samples:
            if not sample.name.endswith("_created"):
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return types, samples


def value(samples: dict[tuple[str, Labels], float], name: str, **labels: str) -> float:
    return samples[(f"cadence:{name}", tuple(sorted({"model_name": "m", **labels}.items())))]


def delta(*outputs: CompletionOutput, queue_time_s: float | None = None) -> RequestOutput:
    return RequestOutput(request_id="r", prompt=None, prompt_token_ids=[], outputs=list(outputs),
                         finished=False, queue_time_s=queue_time_s)


def seq(index: int, num_tokens: int, finish: str | None = None) -> CompletionOutput:
    return CompletionOutput(index=index, text="x" * num_tokens, token_ids=[5] * num_tokens, finish_reason=finish)


def idle_metrics(states: Sequence[EngineState] = ()) -> APIMetrics:
    return APIMetrics("m", 64, lambda: states or [EngineState(None, 0, 10, "fcfs (chunked=true)")])


def test_every_metric_is_named_with_the_cadence_prefix_and_typed() -> None:
    types, samples = parse(idle_metrics().render())
    assert types == {
        **{f"cadence:{name}": "histogram" for name in HISTOGRAMS},
        "cadence:prompt_tokens": "counter", "cadence:generation_tokens": "counter",
        "cadence:request_success": "counter",
        **{f"cadence:{name}": "gauge" for name in ENGINE_GAUGES},
        **{f"cadence:{name}": "counter" for name in ENGINE_COUNTERS},
    }
    # Nothing recorded yet: every request series is zero, no request_success series exists.
    for name in HISTOGRAMS:
        assert value(samples, f"{name}_count") == 0.0
    assert value(samples, "prompt_tokens_total") == value(samples, "generation_tokens_total") == 0.0
    assert not any(name == "cadence:request_success_total" for name, _ in samples)
    les = [dict(labels)["le"] for name, labels in samples if name == "cadence:request_prompt_tokens_bucket"]
    assert les == TOKEN_BUCKETS


def test_a_finished_request_counts_its_tokens_latencies_and_finish_reasons() -> None:
    metrics = idle_metrics()
    timer = RequestTimer(metrics, num_prompt_tokens=7, n=2, arrival=time.monotonic())
    timer.on_delta(delta(seq(0, 1), seq(1, 1), queue_time_s=0.25))
    timer.on_delta(delta(seq(1, 2), queue_time_s=0.25))  # later deltas repeat the queue time
    timer.on_delta(delta(seq(0, 1, "stop"), seq(1, 1, "length")))
    timer.on_delta(delta(seq(1, 0, "length")))  # a sequence is counted as finished once
    timer.close("abort")  # nothing left unfinished
    assert timer.num_generated == 6
    _, samples = parse(metrics.render())
    assert value(samples, "request_success_total", finished_reason="stop") == 1.0
    assert value(samples, "request_success_total", finished_reason="length") == 1.0
    assert ("cadence:request_success_total", (("finished_reason", "abort"), ("model_name", "m"))) not in samples
    assert value(samples, "prompt_tokens_total") == 7.0  # once per request, not per sequence
    assert value(samples, "generation_tokens_total") == 6.0
    assert value(samples, "time_to_first_token_seconds_count") == 1.0
    assert value(samples, "inter_token_latency_seconds_count") == 2.0  # the deltas after the first with tokens
    assert value(samples, "request_queue_time_seconds_count") == 1.0
    assert value(samples, "request_queue_time_seconds_sum") == 0.25
    assert value(samples, "request_queue_time_seconds_bucket", le="0.3") == 1.0
    assert value(samples, "request_queue_time_seconds_bucket", le="0.5") == 1.0
    assert value(samples, "e2e_request_latency_seconds_count") == 1.0
    assert value(samples, "request_prompt_tokens_sum") == 7.0
    assert value(samples, "request_prompt_tokens_bucket", le="5.0") == 0.0
    assert value(samples, "request_prompt_tokens_bucket", le="10.0") == 1.0
    assert value(samples, "request_generation_tokens_sum") == 6.0
    assert value(samples, "request_generation_tokens_bucket", le="5.0") == 0.0
    assert value(samples, "request_generation_tokens_bucket", le="10.0") == 1.0


def test_an_aborted_and_an_errored_request_count_their_unfinished_sequences() -> None:
    metrics = idle_metrics()
    aborted = RequestTimer(metrics, num_prompt_tokens=3, n=1, arrival=time.monotonic())
    aborted.on_delta(delta(seq(0, 1)))
    aborted.close("abort")
    errored = RequestTimer(metrics, num_prompt_tokens=4, n=3, arrival=time.monotonic())
    errored.on_delta(delta(seq(0, 0, "stop")))  # one of three ended before the engine failed it
    errored.close("error")
    _, samples = parse(metrics.render())
    assert value(samples, "request_success_total", finished_reason="abort") == 1.0
    assert value(samples, "request_success_total", finished_reason="error") == 2.0
    assert value(samples, "request_success_total", finished_reason="stop") == 1.0
    # Only the aborted one produced a token: it alone has a first token and counts its prompt.
    assert value(samples, "time_to_first_token_seconds_count") == 1.0
    assert value(samples, "inter_token_latency_seconds_count") == 0.0
    assert value(samples, "prompt_tokens_total") == 3.0
    assert value(samples, "generation_tokens_total") == 1.0
    assert value(samples, "request_queue_time_seconds_count") == 0.0  # neither delta carried one
    # Both ended: end-to-end latency and lengths are observed for each.
    assert value(samples, "e2e_request_latency_seconds_count") == 2.0
    assert value(samples, "request_prompt_tokens_sum") == 7.0
    assert value(samples, "request_generation_tokens_sum") == 1.0
    assert value(samples, "request_generation_tokens_bucket", le="1.0") == 2.0


def test_engine_state_is_read_at_scrape_time_one_series_per_core() -> None:
    stats = SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.25, num_free_blocks=30, num_blocks=40,
                           prefix_cache_queries=100, prefix_cache_hits=64, num_preemptions=5, num_steps=9,
                           step_time_s=0.5, forward_time_s=0.375)
    states = [EngineState(stats, num_pending=4, num_blocks=40, policy="fcfs (chunked=true)"),
              EngineState(None, num_pending=1, num_blocks=12, policy="sjf (aging=2, chunked=true)")]
    metrics = idle_metrics(states)
    _, samples = parse(metrics.render())
    expected = {
        "num_requests_running": (3, 0), "num_requests_waiting": (2, 0), "num_requests_pending": (4, 1),
        "kv_cache_usage_perc": (0.25, 0.0), "kv_cache_num_blocks": (40, 12),
        # A core without stats yet has every block free.
        "kv_cache_free_blocks": (30, 12),
        "prefix_cache_queries_total": (100, 0), "prefix_cache_hits_total": (64, 0),
        "num_preemptions_total": (5, 0), "engine_steps_total": (9, 0), "engine_step_seconds_total": (0.5, 0.0),
        "model_forward_seconds_total": (0.375, 0.0),
    }
    for name, per_engine in expected.items():
        assert (value(samples, name, engine="0"), value(samples, name, engine="1")) == per_engine, name
    # The policy as an info series: the engine's description in a label, value 1.
    for rank, policy in enumerate(("fcfs (chunked=true)", "sjf (aging=2, chunked=true)")):
        assert value(samples, "scheduling_policy_info", engine=str(rank), policy=policy) == 1.0
    states[1] = EngineState(stats, num_pending=0, num_blocks=40, policy="sjf (aging=2, chunked=true)")  # read again
    _, samples = parse(metrics.render())
    assert value(samples, "num_requests_running", engine="1") == 3.0


def one_token(call: Call) -> list[RequestOutput]:
    """Every sequence of the request produces one token and stops."""
    return [RequestOutput(request_id="r", prompt=None, prompt_token_ids=[], finished=True, queue_time_s=0.125,
                          outputs=[CompletionOutput(index=i, text="a", token_ids=[67], finish_reason="stop")
                                   for i in range(call.request.params.n)])]


def test_the_app_serves_what_its_requests_and_engine_recorded() -> None:
    stats = SchedulerStats(num_running=1, num_waiting=0, kv_cache_usage=0.5, num_free_blocks=5, num_blocks=10,
                           prefix_cache_queries=8, prefix_cache_hits=0, num_preemptions=0)
    engine = ScriptedEngine(one_token, stats=stats, num_pending=2)
    reply = post_json(engine, "/v1/completions", {"prompt": ["Paris", "ab"], "n": 2}, scrape=True)
    assert reply.status == 200, reply.text
    content_type, body = reply.metrics_content_type, reply.metrics
    assert content_type == CONTENT_TYPE_LATEST
    _, samples = parse(body)
    # Two prompts of two tokens, two sequences each, one token per sequence.
    assert value(samples, "request_success_total", finished_reason="stop") == 4.0
    assert value(samples, "prompt_tokens_total") == 4.0
    assert value(samples, "generation_tokens_total") == 4.0
    assert value(samples, "e2e_request_latency_seconds_count") == 2.0  # one per engine request
    assert value(samples, "request_queue_time_seconds_sum") == 0.25
    assert value(samples, "kv_cache_num_blocks", engine="0") == 10.0  # the null block left out
    assert value(samples, "kv_cache_free_blocks", engine="0") == 5.0
    assert value(samples, "num_requests_pending", engine="0") == 2.0
