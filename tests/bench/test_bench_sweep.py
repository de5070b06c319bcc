"""``cadence bench sweep`` against the scripted completions server: every server at every rate, the
same requests each time, a table, JSON and a PNG; and the ShareGPT-like length mix."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from support.sse_server import TOKENS_PER_REPLY

from cadence.bench import sweep
from cadence.bench.datasets import SHAREGPT_LIKE, LengthMix, length_mix_requests
from cadence.bench.plotting import pyplot
from cadence.sim.workload import LengthDist


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    sweep.add_arguments(parser)
    return parser.parse_args(["--model", "m", "--disable-tqdm", *argv])


def test_every_server_runs_every_rate_on_the_same_requests(server: str, tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    out, png = tmp_path / "curve.json", tmp_path / "curve.png"
    ns = _args("--server", f"a={server}", "--server", f"b={server}/", "--request-rates", "50,inf",
               "--num-prompts", "6", "--input-len", "4", "--output-len", "5", "--goodput", "ttft:5000",
               "--output-json", str(out), "--plot", str(png))
    assert sweep.run(ns) == 0
    data = json.loads(out.read_text())
    assert data["servers"] == {"a": server, "b": server}
    for name in ("a", "b"):
        curve = data["curves"][name]
        assert [point["request_rate"] for point in curve] == [50, math.inf]
        for point in curve:
            assert (point["completed"], point["failed"]) == (6, 0)
            assert point["total_output_tokens"] == 6 * TOKENS_PER_REPLY
            assert point["request_goodput"] == pytest.approx(point["request_throughput"])  # all within 5 s
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in table[-5:-1]] == [["a", "50"], ["a", "inf"], ["b", "50"], ["b", "inf"]]


@pytest.mark.parametrize(("items", "message"), [(["a"], "NAME=URL"), (["=u"], "NAME=URL"), ([" =u"], "NAME=URL"),
                                                (["a=u", "a=v"], "given twice"), (["a=u", "a =v"], "given twice")])
def test_bad_servers_are_refused(items: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        sweep.parse_servers(items)


def test_a_missing_matplotlib_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now raises ImportError
    with pytest.raises(RuntimeError, match=r"plots need matplotlib: pip install 'cadence\[sim\]'$"):
        sweep.plot({"a": []}, tmp_path / "curve.png")
    with pytest.raises(RuntimeError, match=r"\(or pass --no-plots\)"):
        pyplot(" (or pass --no-plots)")


def test_rates_are_positive_numbers_or_inf() -> None:
    assert sweep.parse_rates("0.5, 2,inf") == [0.5, 2.0, math.inf]
    for bad in ("0", "-1", "x", "1,,2", "nan"):
        with pytest.raises(ValueError, match="positive"):
            sweep.parse_rates(bad)


def test_the_sharegpt_like_mix_is_seeded_capped_and_heavy_tailed() -> None:
    requests = length_mix_requests(4000, SHAREGPT_LIKE, vocab_size=1000, seed=3)
    assert requests == length_mix_requests(4000, SHAREGPT_LIKE, vocab_size=1000, seed=3)
    inputs = np.array([r.prompt_len for r in requests])
    outputs = np.array([r.output_len for r in requests])
    assert all(len(r.prompt) == r.prompt_len and all(100 <= t < 1000 for t in r.prompt) for r in requests[:50])
    assert inputs.min() >= 1 and inputs.max() <= 1024 and outputs.min() >= 1 and outputs.max() <= 1024
    # Lognormal: the median well under the mean; means near 240 and 190 (a little less: the caps).
    assert np.median(inputs) < 0.7 * inputs.mean() and 200 < inputs.mean() < 250
    assert np.median(outputs) < 0.8 * outputs.mean() and 170 < outputs.mean() < 200
    fixed = LengthMix(LengthDist("fixed", (9.0,)), LengthDist("fixed", (3.0,)), 5, 5)
    assert {(r.prompt_len, r.output_len) for r in length_mix_requests(5, fixed, 1000, 0)} == {(5, 3)}
