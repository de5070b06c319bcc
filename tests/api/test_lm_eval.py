"""lm-eval's ``local-completions`` model against ``cadence serve``: its log-likelihood path sends
each context and continuation as token ids with ``echo`` and ``logprobs`` and reads the prompt's
logprobs back. On a small multiple-choice task made of local files (no dataset download), every
log-likelihood it reports equals transformers' on the same tokens (fp32)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path

import httpx
import pytest
from support.reference import hf_log_softmax
from transformers import AutoTokenizer

from cadence.api.testing import ServerProcess

TASK = """\
task: cadence_tiny_choice
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
DOCS = [{"question": "The capital of France is", "choices": [" Paris", " Rome"], "answer": 0},
        {"question": "Hello world! How are", "choices": [" you", " blocks"], "answer": 0},
        {"question": "0123456789 +", "choices": [" -", " =", " ("], "answer": 1}]


def test_lm_eval_log_likelihoods_equal_transformers(
        serve_tiny: Callable[..., AbstractContextManager[ServerProcess]], make_tiny_model: Callable[..., Path],
        tmp_path: Path) -> None:
    folder = make_tiny_model("llama")
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "task.yaml").write_text(TASK.format(data=tmp_path / "data.jsonl"))
    with serve_tiny() as server:
        model = httpx.get(f"{server.url}/v1/models").json()["data"][0]["id"]
        args = f"model={model},base_url={server.url}/v1/completions,tokenizer_backend=huggingface,tokenizer={folder}"
        run = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", args,
             "--tasks", "cadence_tiny_choice", "--include_path", str(tmp_path), "--log_samples",
             "--output_path", str(tmp_path / "out")],
            capture_output=True, text=True, timeout=300, env={**os.environ, "HF_DATASETS_OFFLINE": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    (samples,) = (tmp_path / "out").glob("*/samples_cadence_tiny_choice_*.jsonl")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    checked = 0
    for line in samples.read_text().splitlines():
        sample = json.loads(line)
        for args_of, (loglikelihood, _) in zip(sample["arguments"].values(), sample["filtered_resps"], strict=True):
            context, continuation = args_of["arg_0"], args_of["arg_1"]
            # lm-eval's split: the continuation's tokens are what the context's encoding leaves of the whole's.
            whole = tokenizer(context + continuation).input_ids
            cut = len(tokenizer(context).input_ids)
            reference = hf_log_softmax(folder, whole[:cut], whole[cut:])
            expected = sum(reference[i, token].item() for i, token in enumerate(whole[cut:]))
            assert float(loglikelihood) == pytest.approx(expected, abs=1e-3)
            checked += 1
    assert checked == sum(len(doc["choices"]) for doc in DOCS)
