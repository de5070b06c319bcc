"""``python -m cadence`` (``cadence/__main__.py``): the module runs the CLI only as ``__main__`` (the
engine core's and the workers' processes import the parent's main module again), ``--help`` lists
the verbs, and the CLI imports none of the engine stack."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest

import cadence.__main__
from cadence.cli import main

VERBS = ["generate", "policies", "trace", "serve", "bench", "simulate"]


def test_importing_the_module_runs_nothing() -> None:
    assert cadence.__main__.main is main


def test_running_it_as_main_runs_the_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["cadence", "--help"])
    monkeypatch.setenv("COLUMNS", "100")  # argparse wraps the help to the terminal's width
    monkeypatch.delitem(sys.modules, "cadence.__main__")  # runpy runs it afresh (restored afterwards)
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("cadence", run_name="__main__")
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: cadence ")
    assert "{" + ",".join(VERBS) + "}" in out
    for verb in VERBS:
        assert f"\n    {verb} " in out


def test_a_missing_verb_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["cadence"])
    monkeypatch.delitem(sys.modules, "cadence.__main__")
    with pytest.raises(SystemExit) as exit_info:
        runpy.run_module("cadence", run_name="__main__")
    assert exit_info.value.code == 2
    assert "the following arguments are required: verb" in capsys.readouterr().err


def test_the_cli_imports_no_engine_stack() -> None:
    """Building the parser imports no model, executor or simulator code, nor transformers: the
    engine core's children import ``__main__`` again, and every verb's start would pay for them."""
    heavy = ["transformers", "cadence.executor", "cadence.models.loader", "cadence.sim.simulator", "scipy.optimize"]
    script = f"import sys, cadence.cli; cadence.cli.build_parser(); print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=True)
    assert done.stdout.strip() == "[]"
