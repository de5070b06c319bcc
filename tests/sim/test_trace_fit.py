"""Calibration from a scheduling trace (``cadence simulate calibrate --from-trace``): the steps are
rebuilt from the trace as the executor ran them, and their cycles fitted as a calibration's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from cadence.cli import main
from cadence.core.cost_model import CostModel
from cadence.core.engine_description import engine_description
from cadence.engine.llm import LLM
from cadence.sampling_params import SamplingParams
from cadence.sim.calibrate import timing
from cadence.sim.cost_store import FitKey
from cadence.sim.simulator import EngineLimits, simulate
from cadence.sim.trace_fit import fit_traces, trace_steps
from cadence.sim.workload import synthetic_workload

# Every feature a served step can move, and a row limit: a hinge at 16 rows.
TRUTH = CostModel({"const": 0.008, "prefill_tokens": 3e-3, "decode_seqs": 3.5e-3, "kv_tokens": 9e-6,
                   "prefill_attn": 2e-6, "prefills": 0.015, "kernel_rows": 4.5e-3},
                  {"kernel_row_limit": 16, "model": "m", "dtype": "float32", "quantization": "gguf", "threads": 2})


def _simulated_trace(path: Path, cost_model: CostModel = TRUTH) -> None:
    """A burst (steps back to back, as a loaded server's) of varied lengths, traced."""
    workload = synthetic_workload(60, input_len="lognormal:200:1", output_len="lognormal:60:0.8", seed=0)
    simulate(workload, EngineLimits(), "fcfs", cost_model, trace_scheduling=path)


def test_a_simulated_trace_gives_back_the_cost_model_it_ran_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.jsonl"
    _simulated_trace(trace)
    model, quality = fit_traces([trace])
    # Features the truth leaves out come back as zero, up to the solver's rounding.
    expected = {name: TRUTH.coefficients.get(name, 0.0) for name in model.coefficients}
    assert model.coefficients == pytest.approx(expected, rel=1e-6, abs=1e-12)
    assert quality.median_rel_error < 1e-9 and quality.total_time_ratio == pytest.approx(1.0)
    assert model.row_limit == 16 and model.metadata["simulated"] is True
    assert model.metadata["source"] == "scheduling trace" and model.metadata["traces"] == [str(trace)]
    # The verb writes it, and keeps no simulated fit as this machine's.
    monkeypatch.setenv("CADENCE_COST_MODELS_DIR", str(tmp_path / "fits"))
    assert main(["simulate", "calibrate", "--from-trace", str(trace), "--output", str(tmp_path / "fit.json")]) == 0
    assert CostModel.load(tmp_path / "fit.json").coefficients == model.coefficients
    assert not (tmp_path / "fits").exists() and "stored" not in capsys.readouterr().err


def test_traces_it_cannot_fit_are_refused_with_why(tmp_path: Path) -> None:
    def write(name: str, *events: dict[str, object]) -> Path:
        path = tmp_path / name
        path.write_text("".join(json.dumps(e) + "\n" for e in events))
        return path

    old = write("old.jsonl", {"event": "arrival", "step": 1, "t": 0.0, "request": "a"})
    with pytest.raises(ValueError, match="does not open with the engine it ran on"):
        trace_steps(old)
    speculative = write("spec.jsonl", {"event": "engine", "step": 0, "t": 0.0, "speculative": "ngram"})
    with pytest.raises(ValueError, match="speculative decoding"):
        trace_steps(speculative)
    (tmp_path / "text.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match="is not a scheduling trace"):
        trace_steps(tmp_path / "text.jsonl")
    broken = write("broken.jsonl", {"event": "engine", "step": 0, "t": 0.0},
                   {"event": "scheduled", "step": 1, "t": 0.0})
    with pytest.raises(ValueError, match="is not a scheduling trace"):
        trace_steps(broken)  # an event without its fields
    with pytest.raises(ValueError, match="is empty"):
        trace_steps(write("empty.jsonl"))
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    _simulated_trace(a)
    _simulated_trace(b, TRUTH.with_metadata(dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"another engine.*dtype 'float32' against 'bfloat16'"):
        fit_traces([a, b])
    few = write("few.jsonl", {"event": "engine", "step": 0, "t": 0.0},
                {"event": "scheduled", "step": 1, "t": 0.0, "request": "a", "tokens": 4, "start": 0, "samples": True},
                {"event": "end", "step": 1, "t": 0.01})
    with pytest.raises(ValueError, match="need at least"):
        fit_traces([few])


def test_the_engine_s_trace_rebuilds_the_steps_its_executor_ran(
        tmp_path: Path, make_tiny_model: Callable[..., Path], monkeypatch: pytest.MonkeyPatch) -> None:
    trace = tmp_path / "trace.jsonl"
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32", max_num_batched_tokens=32, max_num_seqs=4,
              trace_scheduling=str(trace))
    prompts = [[5 + i] * (6 + 9 * i) for i in range(6)]  # chunked up to 32 tokens a step beside decodes
    with timing(llm) as timer:
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    description, steps = trace_steps(trace)
    core = llm.engine_core
    assert description == {**engine_description(llm.config, core.hf_config, core.executor), "simulated": False}
    assert [s.shape for s in steps] == [s.shape for s in timer.steps] and len(steps) > 20
    # Each traced step spans the executor's (scheduled before it starts, ended after it returns), on
    # another clock (the wall's: arrivals are stamped with it): its length is at least the executor's.
    assert all(t.end - t.start >= e.end - e.start - 1e-4 for t, e in zip(steps, timer.steps, strict=True))
    assert description["simulated"] is False and description["kernel_row_limit"] is None
    assert description["model"] == Path(llm.config.model.path).name and description["dtype"] == "float32"
    # A real engine's fit is stored as this machine's for the engine the trace describes.
    monkeypatch.setenv("CADENCE_COST_MODELS_DIR", str(tmp_path / "fits"))
    assert main(["simulate", "calibrate", "--from-trace", str(trace)]) == 0
    key = FitKey(description["model"], "float32", "none", description["threads"],  # the threads it ran with
                 description["kernels"])
    stored = CostModel.load(key.path)
    assert stored.metadata["source"] == "scheduling trace" and stored.metadata["fit"]["num_samples"] > 0
