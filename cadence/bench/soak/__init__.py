"""Soak test for ``cadence serve``: minutes of mixed load, then a verdict on memory, requests and the KV pool.

A benchmark, never part of the test suite (its judging functions are tested in tests/bench/test_soak.py).

    python -m cadence bench soak [--minutes 10] [--concurrency 16] [--model PATH]
                                 [--server-arg="--max-num-seqs 64"] [--max-rss-growth-mib 64] [--output-json F]
    python -m cadence bench soak --base-url http://127.0.0.1:8000 [--api-key KEY]   # a server already running

(``python benchmarks/soak.py`` takes the same flags.) Without ``--base-url`` it starts ``python -m
cadence serve`` itself (``cadence.api.testing.ServerProcess``, on a free port; ``--server-arg`` is
split like a shell line and passed through, repeatable) and stops it at the end. With ``--base-url``
it cannot see the server's processes: memory is not measured (nor judged), and other clients of that
server would disturb the idle check.

The load: ``--concurrency`` clients, each sending one request after another until the time is up, the
kind drawn from MIX (``--mix`` reweighs it): chat and completions, streamed and not, ``n`` > 1
sometimes, prompts of random words (3 to 1,200; fewer where the context is short) or a long prefix
shared with other requests (prefix-cache hits), short and long ``max_tokens``, stop strings, a small
JSON schema, logprobs; ``disconnect`` streams close the connection after a few chunks, ``cancel``
requests (not streamed, EOS ignored) time out client-side part-way through their expected generation
time, a quarter of them within 100 ms with a prompt of 2,000-4,000 words (while it is still being
tokenized, admitted and submitted).

Every request ends as exactly one of: completed (HTTP 200, a valid body or stream: the expected
number of choices, each with finish_reason stop/length, ``[DONE]``, usage, JSON that parses where a
schema was asked for), abandoned on purpose (the client closed or timed out by design), or lost
(anything else: a 4xx/5xx, an error event, a malformed body, a transport error, or no end within
``--hang-guard-s``).

Sampled every ``--sample-interval-s``: the RSS of the API process and of each of its descendants
(engine core, workers) from /proc, and /metrics (KV usage, running, waiting, pending, tokens).

The verdict (exit status 1 with the reasons, 0 when all hold; 2 if the server does not start):
- RSS: for each process, the median of the first samples after the warm-up (20% of the run, at least
  a minute, at most half of it) against the median of the last samples before the load stops; more
  than ``--max-rss-growth-mib`` of growth fails. Medians of several samples: one spike is not growth.
- requests: any lost request fails.
- KV pool: after the load stops and the server drains, every engine must be idle: nothing running,
  waiting or pending, ``kv_cache_usage_perc`` 0 and every block free. Idle usage is 0 with or without
  prefix caching: ``KVAllocator.usage`` counts blocks outside the free list, and a freed block keeps
  its hash (a prefix-cache hit) while it sits in the free list.
- a server this script started must not exit during the run, and must exit 0 when stopped.

The modules: ``load`` (the request kinds, and the clients' sending), ``outcome`` (each request's
outcome and the accounting by kind), ``probe`` (RSS from /proc, /metrics samples), ``verdict`` (the
pure judging of the run), ``run`` (the clients, the sampler and the drain), ``report`` (the tables
and the JSON summary), ``cli`` (the flags, the server's start and stop, the exit status).
"""
