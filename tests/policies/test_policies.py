"""Policy selection and options, and the promise that policies reorder but never change results."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from cadence import LLM, SamplingParams
from cadence.policies.base import PolicyContext
from cadence.policies.loader import installed_policies, load_policy

BUILT_INS = ["chunked-prefill", "fair", "fcfs", "priority", "sjf"]
CONTEXT = PolicyContext(max_num_batched_tokens=64, max_num_seqs=4, enable_chunked_prefill=True,
                        long_prefill_token_threshold=0)


def test_every_built_in_is_registered_as_an_entry_point() -> None:
    assert set(BUILT_INS) <= set(installed_policies())
    for name in BUILT_INS:
        assert load_policy(name, CONTEXT).name == name


def test_an_unknown_policy_lists_the_installed_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown scheduling policy .lottery.; installed policies: "
                                         "chunked-prefill, fair, fcfs, priority, sjf"):
        load_policy("lottery", CONTEXT)


@pytest.mark.parametrize(("name", "options", "message"), [
    ("fcfs", {"aging": "1"}, r"does not take option\(s\) \['aging'\]; it accepts \['chunked'\]"),
    ("sjf", {"aging": "-1"}, r"aging='-1' must be a number >= 0"),
    ("fair", {"output_weight": "lots"}, r"output_weight='lots' must be a number"),
    ("priority", {"chunked": "maybe"}, r"chunked='maybe' must be true or false"),
])
def test_bad_options_say_what_to_change(name: str, options: dict[str, str], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_policy(name, CONTEXT, options)


def test_chunking_is_an_option_of_every_policy_on_by_default_as_the_engine_says() -> None:
    assert load_policy("fcfs", CONTEXT).chunked
    assert not load_policy("fcfs", CONTEXT, {"chunked": "false"}).chunked
    assert load_policy("chunked-prefill", CONTEXT).chunked
    for name in ["priority", "fair", "sjf"]:
        assert load_policy(name, CONTEXT).chunked
        assert not load_policy(name, CONTEXT, {"chunked": "false"}).chunked


def test_chunking_needs_the_engine_to_allow_it() -> None:
    unchunked = PolicyContext(512, 4, enable_chunked_prefill=False, long_prefill_token_threshold=0)
    with pytest.raises(ValueError, match=r"chunked=true splits prompts.*--no-enable-chunked-prefill"):
        load_policy("chunked-prefill", unchunked)
    assert not load_policy("priority", unchunked).chunked


# ---- real engine runs: every policy, the same greedy tokens as fcfs --------------------------

ENGINE: dict[str, Any] = {"dtype": "float32", "num_kv_blocks": 24, "block_size": 8, "max_num_seqs": 4,
          "max_num_batched_tokens": 48}
POLICY_RUNS: dict[str, dict[str, Any]] = {
    "chunked-prefill": {"policy": "chunked-prefill", "long_prefill_token_threshold": 16},
    "priority": {"policy": "priority"},
    "priority-chunked": {"policy": "priority", "policy_options": {"chunked": "true"}},
    "sjf": {"policy": "sjf", "policy_options": {"aging": "2"}},
    "fair": {"policy": "fair"},
    "fair-chunked": {"policy": "fair", "policy_options": {"chunked": "true"}},
    "prompt-cap": {"max_prompts_per_step": 2},  # not a policy: a bound under every one
}


@pytest.fixture(scope="module")
def workload(make_tiny_model: Callable[..., Path]) -> tuple[str, list[list[int]], list[int], list[str], list]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 320) for _ in range(rng.randint(4, 70))] for _ in range(10)]
    prompts[1] = prompts[0][:24] + prompts[1]  # shared prefix: the prefix cache hits
    priorities = [rng.randrange(3) for _ in prompts]
    users = [rng.choice(["ann", "bob", "cy"]) for _ in prompts]
    folder = str(make_tiny_model("llama"))
    fcfs = _greedy(LLM(model=folder, **ENGINE), prompts, priorities, users)
    return folder, prompts, priorities, users, fcfs


def _greedy(llm: LLM, prompts: list[list[int]], priorities: list[int], users: list[str]) -> list[list[int]]:
    params = [SamplingParams(temperature=0, max_tokens=8 + i % 5, ignore_eos=True) for i in range(len(prompts))]
    outputs = llm.generate(prompts, params, use_tqdm=False, priority=priorities, users=users)
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("run", list(POLICY_RUNS))
def test_policies_reorder_but_never_change_greedy_tokens(workload: tuple, run: str) -> None:
    folder, prompts, priorities, users, fcfs = workload
    llm = LLM(model=folder, **{**ENGINE, **POLICY_RUNS[run]})
    assert _greedy(llm, prompts, priorities, users) == fcfs
    if run.startswith("priority"):
        assert llm.engine_core.scheduler.num_preemptions > 0  # 24 blocks of 8 do not hold the batch
    if run == "prompt-cap":
        assert llm.engine_core.scheduler.config.max_prompts_per_step == 2


def test_generate_takes_one_priority_and_user_per_prompt(make_tiny_model: Callable[..., Path]) -> None:
    llm = LLM(model=str(make_tiny_model("llama")), dtype="float32", policy="priority")
    with pytest.raises(ValueError, match="priority takes one value per prompt: a sequence of 2"):
        llm.generate([[5, 6], [7, 8]], use_tqdm=False, priority=[1])
    with pytest.raises(ValueError, match="users takes one value per prompt"):
        llm.generate([[5, 6], [7, 8]], use_tqdm=False, users="ann")
