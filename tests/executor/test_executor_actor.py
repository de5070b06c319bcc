"""The executor actor with a fake executor: each step's result goes to the reply mailbox in order, a
failed step is reported as ``ExecutorFailed`` and crashes the actor, and a worker death between
steps crashes it at once."""

from __future__ import annotations

import threading
from typing import Any

import anyio
import pytest

from cadence.executor.actor import ExecutorActor
from cadence.executor.base import Executor, WorkerError
from cadence.messages import ExecutorFailed, ModelRunnerOutput, SchedulerOutput

# A hang guard only: every test here finishes in milliseconds.
HANG_GUARD_S = 30


def step(step_id: int, *request_ids: str) -> SchedulerOutput:
    return SchedulerOutput(step_id=step_id, new_requests=[], cached_requests=[],
                           num_scheduled_tokens=dict.fromkeys(request_ids, 1), finished_request_ids=[],
                           preempted_request_ids=[])


class Replies:
    """The scheduler actor's side: collects what the executor actor sends."""

    def __init__(self) -> None:
        self.messages: list[Any] = []
        self.arrived = anyio.Event()
        self.closed = False

    async def send(self, message: Any) -> None:
        self.messages.append(message)
        self.arrived.set()

    def close(self) -> None:
        self.closed = True


class FakeExecutor(Executor):
    num_blocks = 8

    def __init__(self, fail_on: int | None = None) -> None:
        self.fail_on = fail_on
        self.steps: list[int] = []
        self.threads: list[threading.Thread] = []
        self.results: list[ModelRunnerOutput] = []

    def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(step.step_id)
        self.threads.append(threading.current_thread())
        if step.step_id == self.fail_on:
            raise RuntimeError(f"step {step.step_id} blew up")
        ids = list(step.num_scheduled_tokens)
        result = ModelRunnerOutput(step.step_id, ids, [100 * step.step_id + i for i in range(len(ids))])
        self.results.append(result)
        return result


class DyingExecutor(FakeExecutor):
    """Its watch reports a dead worker once ``die`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.die = anyio.Event()

    async def watch_workers(self) -> None:
        await self.die.wait()
        raise WorkerError("worker rank 1 died (SIGKILL)")


def test_each_step_yields_the_executors_output_in_order() -> None:
    executor, replies = FakeExecutor(), Replies()
    actor = ExecutorActor(executor, replies)
    loop_thread: list[threading.Thread] = []

    async def main() -> None:
        loop_thread.append(threading.current_thread())
        for i, ids in enumerate([("a", "b"), ("a",), ("b", "c")], start=1):
            await actor.send(step(i, *ids))
        actor.close()
        with anyio.fail_after(HANG_GUARD_S):
            await actor.run()  # ends with the inbox, though the default watch never returns

    anyio.run(main)
    assert executor.steps == [1, 2, 3]
    assert len(replies.messages) == 3
    assert all(got is want for got, want in zip(replies.messages, executor.results, strict=True))
    assert [m.sampled_token_ids for m in replies.messages] == [[100, 101], [200], [300, 301]]
    # Steps run in a worker thread, so the event loop stays free during the forward pass.
    assert all(t is not loop_thread[0] for t in executor.threads)
    assert not replies.closed  # the mailbox belongs to the scheduler actor


def test_a_failed_step_is_reported_then_crashes_the_actor() -> None:
    executor, replies = FakeExecutor(fail_on=2), Replies()
    actor = ExecutorActor(executor, replies)

    async def main() -> None:
        for i in (1, 2, 3):
            await actor.send(step(i, "a"))
        actor.close()
        with anyio.fail_after(HANG_GUARD_S), pytest.raises(RuntimeError, match="step 2 blew up"):
            await actor.run()  # the error itself, not an ExceptionGroup

    anyio.run(main)
    assert executor.steps == [1, 2]  # nothing after the failed step
    first, failed = replies.messages
    assert isinstance(first, ModelRunnerOutput) and first.step_id == 1
    assert failed == ExecutorFailed(2, "RuntimeError: step 2 blew up")


def test_a_worker_error_raised_by_a_step_is_reported_with_its_type() -> None:
    class Failing(FakeExecutor):
        def execute_model(self, step: SchedulerOutput) -> ModelRunnerOutput:
            raise WorkerError("worker rank 1 exited with code 1")

    replies = Replies()
    actor = ExecutorActor(Failing(), replies)

    async def main() -> None:
        await actor.send(step(5, "a"))
        with anyio.fail_after(HANG_GUARD_S), pytest.raises(WorkerError):
            await actor.run()  # the inbox is still open: the failure alone ends the run

    anyio.run(main)
    assert replies.messages == [ExecutorFailed(5, "WorkerError: worker rank 1 exited with code 1")]


def test_a_worker_death_between_steps_crashes_the_actor_at_once() -> None:
    executor, replies = DyingExecutor(), Replies()
    actor = ExecutorActor(executor, replies)

    async def kill_after_first_reply() -> None:
        await replies.arrived.wait()
        executor.die.set()

    async def main() -> None:
        await actor.send(step(1, "a"))
        # The inbox stays open and empty: only the watch can end the run.
        with anyio.fail_after(HANG_GUARD_S):
            async with anyio.create_task_group() as group:
                group.start_soon(kill_after_first_reply)
                with pytest.raises(WorkerError, match="worker rank 1 died"):
                    await actor.run()

    anyio.run(main)
    assert executor.steps == [1]
    assert [type(m) for m in replies.messages] == [ModelRunnerOutput]  # no ExecutorFailed: no step failed


def test_the_base_executor_is_abstract_and_its_shutdown_does_nothing() -> None:
    with pytest.raises(TypeError):
        Executor()  # type: ignore[abstract]
    executor = FakeExecutor()
    executor.shutdown()
    executor.shutdown()
    assert executor.execute_model(step(1, "a")).sampled_token_ids == [100]
