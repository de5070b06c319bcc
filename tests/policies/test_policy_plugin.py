"""A third-party policy, built from the example in docs/policies.md, installed with pip as a separate
distribution and run by name, exactly as a user would."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from cadence import LLM, SamplingParams

DOCS = Path(__file__).resolve().parents[2] / "docs" / "policies.md"
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16], [17, 18]]
PARAMS = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)

# Runs in a fresh interpreter that sees the plugin only through the --target folder on PYTHONPATH.
RUN_WITH_PLUGIN = """
import json, sys
from cadence import LLM, SamplingParams
from cadence.policies.loader import installed_policies

llm = LLM(model=sys.argv[1], dtype="float32", policy="lifo", max_num_seqs=1)
orders = []
order_waiting = llm.engine_core.scheduler.policy.order_waiting
def spy(waiting):
    ordered = order_waiting(waiting)
    orders.append([r.request_id for r in ordered])
    return ordered
llm.engine_core.scheduler.policy.order_waiting = spy
params = SamplingParams(**json.loads(sys.argv[3]))
outputs = llm.generate(json.loads(sys.argv[2]), params, use_tqdm=False)
print(json.dumps({"installed": installed_policies(), "module": type(llm.engine_core.scheduler.policy).__module__,
                  "tokens": [o.outputs[0].token_ids for o in outputs],
                  "orders": [o for o in orders if len(o) > 1]}))
"""


def _docs_block(label: str, language: str) -> str:
    """The code block that follows the `label` line in docs/policies.md."""
    match = re.search(rf"^`{re.escape(label)}`\n\n```{language}\n(.*?)^```", DOCS.read_text(), re.M | re.S)
    assert match, f"docs/policies.md has no {language} block for {label}"
    return match.group(1)


def test_the_documented_example_is_under_40_lines() -> None:
    assert len(_docs_block("lifo_policy.py", "python").splitlines()) < 40


def test_a_third_party_policy_installs_and_runs_by_name(tmp_path: Path, make_tiny_model: Callable[..., Path]) -> None:
    source = tmp_path / "cadence-lifo"
    source.mkdir()
    (source / "lifo_policy.py").write_text(_docs_block("lifo_policy.py", "python"))
    (source / "pyproject.toml").write_text(_docs_block("pyproject.toml", "toml"))
    site = tmp_path / "site"
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1", "PIP_NO_INPUT": "1"}
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(source)],
                   check=True, env=env, cwd=tmp_path, capture_output=True, timeout=120)
    assert list(site.glob("cadence_lifo-*.dist-info"))

    folder = str(make_tiny_model("llama"))
    params = {"temperature": 0, "max_tokens": 6, "ignore_eos": True}
    result = subprocess.run([sys.executable, "-c", RUN_WITH_PLUGIN, folder, json.dumps(PROMPTS), json.dumps(params)],
                            env={**env, "PYTHONPATH": str(site)}, cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert "lifo" in report["installed"] and report["module"] == "lifo_policy"
    # With one seat the others queue up behind the first; the plugin puts the newest first.
    assert report["orders"] and all(o == sorted(o, key=int, reverse=True) for o in report["orders"])
    fcfs = LLM(model=folder, dtype="float32").generate(PROMPTS, PARAMS, use_tqdm=False)
    assert report["tokens"] == [o.outputs[0].token_ids for o in fcfs]
