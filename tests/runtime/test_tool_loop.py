"""The inner loop: answers, tool calls, guards, limits, hooks, resume; every run ends."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from pydantic import BaseModel
from typing_extensions import TypedDict

from keel.context import is_runtime_note
from keel.errors import (
    LoopDetectedError,
    MalformedResponseError,
    ModelTimeoutError,
    ModelUnavailableError,
    StepLimitError,
    TimeLimitError,
    ToolArgumentsError,
    ToolInDoubtError,
)
from keel.guards import GuardConfig
from keel.messages import Message, Usage
from keel.models import Completion
from keel.runtime import LoopHooks, LoopResult, StepRecord, ToolLoop
from keel.testing import ScriptedCall, ScriptedModel
from keel.tools import InMemoryJournal, ToolRegistry, tool

booked: list[str] = []


@tool(side_effect=True, idempotent=False)
def book_flight(flight: str, passengers: int) -> str:
    """Book seats on a flight."""
    booked.append(flight)
    return f"booked {passengers} on {flight}"


@tool
def get_weather(city: str) -> str:
    """Weather in a city."""
    return f"sunny in {city}"


@tool
def lookup(code: int) -> str:
    """Look up a code."""
    raise RuntimeError(f"service down for {code}")


REGISTRY = ToolRegistry([book_flight, get_weather, lookup])
USER = [Message.system("You book flights."), Message.user("Book AF1 for two.")]


@pytest.fixture(autouse=True)
def _clear() -> None:
    booked.clear()


def call(name: str, arguments: Any) -> Message:
    raw = arguments if isinstance(arguments, str) else json.dumps(arguments)
    return ScriptedModel.tool_call(name, raw)


def assert_calls_answered(result: LoopResult) -> None:
    """Invariant 2: every tool call in the history has its result right after it."""
    history = result.messages
    for position, message in enumerate(history):
        if message.role == "assistant" and message.tool_calls:
            following = history[position + 1 : position + 1 + len(message.tool_calls)]
            assert [m.tool_call_id for m in following] == [c.id for c in message.tool_calls]


async def test_tool_call_then_answer() -> None:
    model = ScriptedModel(
        [call("book_flight", {"flight": "AF1", "passengers": 2}), "Booked AF1 for two."]
    )
    result = await ToolLoop(model, REGISTRY).arun(USER, session_id="s1")
    assert result.ok and result.status == "completed"
    assert result.text == "Booked AF1 for two."
    assert booked == ["AF1"]
    assert [step.action for step in result.steps] == ["tool_calls", "final"]
    first = result.steps[0]
    assert first.tool_results[0].content == "booked 2 on AF1"
    assert first.tool_results[0].arguments == {"flight": "AF1", "passengers": 2}
    assert first.usage.prompt_tokens > 0 and first.model_latency_ms is not None
    assert result.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in result.steps)
    assert [m.role for m in result.new_messages] == ["assistant", "tool", "assistant"]
    assert model.calls[0].tools[0]["function"]["name"] == "book_flight"
    assert_calls_answered(result)


def test_sync_twin() -> None:
    result = ToolLoop(ScriptedModel(["Hello."]), REGISTRY).run(USER, session_id="s1")
    assert result.ok and result.text == "Hello." and result.error is None


async def test_errors_are_fed_back_and_the_model_recovers() -> None:
    model = ScriptedModel(
        [
            call("bok_flight", {"flight": "AF1", "passengers": 2}),
            call("book_flight", {"flight": "AF1", "passengers": "two"}),
            call("book_flight", "{'flight': 'AF1', 'passengers': '2',}"),
            "Booked.",
        ]
    )
    result = await ToolLoop(model, REGISTRY).arun(USER, session_id="s1")
    assert result.ok and booked == ["AF1"] and result.repairs == 1
    seen = [m.content for m in model.calls[1].messages if m.role == "tool"]
    assert "Did you mean: book_flight?" in seen[0]
    seen = [m.content for m in model.calls[2].messages if m.role == "tool"]
    assert "Field 'passengers': Input should be a valid integer" in seen[1]
    statuses = [r.status for s in result.steps for r in s.tool_results]
    assert statuses == ["unknown_tool", "invalid_arguments", "ok"]
    assert result.steps[2].tool_results[0].repairs


async def test_retry_cap_asks_the_user() -> None:
    model = ScriptedModel(
        [call("book_flight", {"flight": f"AF{i}", "passengers": "x"}) for i in range(5)]
    )
    result = await ToolLoop(model, REGISTRY).arun(USER, session_id="s1")
    assert result.status == "tool_retry_limit"
    assert isinstance(result.error, ToolArgumentsError)
    assert len(model.calls) == 3  # one call and two retries
    assert "book_flight" in result.text and "how you'd like to proceed" in result.text
    assert result.final_message.metadata["keel_stop"] == "tool_retry_limit"
    # keel's words for the user are not in the run's conversation, as the model's or anyone's:
    # a caller that continues from it never shows the model an apology it did not make.
    assert result.final_message not in result.messages
    assert not any("how you'd like to proceed" in m.content for m in result.new_messages)
    assert not result.reverted  # not a guard limit
    assert_calls_answered(result)


async def test_retry_cap_can_raise_to_the_caller() -> None:
    model = ScriptedModel([call("lookup", {"code": i}) for i in range(5)])
    loop = ToolLoop(model, REGISTRY, guards=GuardConfig(fallback="raise", max_tool_retries=0))
    with pytest.raises(Exception, match="service down for 0"):
        await loop.arun(USER, session_id="s1")


async def test_first_loop_detection_warns_second_stops() -> None:
    reverted: list[Exception] = []
    model = ScriptedModel([call("get_weather", {"city": "Paris"})], repeat_last=True)
    loop = ToolLoop(model, REGISTRY, hooks=LoopHooks(revert_to_last_good=reverted.append))
    result = await loop.arun(USER, session_id="s1")
    assert result.status == "loop_detected" and result.loops_detected == 2
    assert isinstance(result.error, LoopDetectedError)
    assert any("called 3 times" in line for line in result.error.evidence)
    statuses = [r.status for s in result.steps for r in s.tool_results]
    assert statuses == ["ok", "ok", "blocked", "blocked"]
    warning = [m for m in model.calls[3].messages if m.role == "system"][-1]
    assert "Loop detected" in warning.content and "Change approach" in warning.content
    assert is_runtime_note(warning)  # keel's words, marked as such (never summarized)
    assert reverted == [result.error] and result.reverted
    assert "repeating the same steps" in result.text
    assert_calls_answered(result)


async def test_oscillation_is_a_loop() -> None:
    a = call("get_weather", {"city": "Paris"})
    b = call("get_weather", {"city": "Rome"})
    model = ScriptedModel([a, b, a, b, a, b, a, b])
    result = await ToolLoop(model, REGISTRY).arun(USER, session_id="s1")
    assert result.status == "loop_detected"
    kinds = [e for s in result.steps for e in s.guard_events if e.startswith("loop")]
    assert kinds[0] == "loop warning: oscillation"


async def test_warned_model_that_changes_approach_completes() -> None:
    same = call("get_weather", {"city": "Paris"})
    model = ScriptedModel([same, same, same, "It is sunny in Paris."])
    result = await ToolLoop(model, REGISTRY).arun(USER, session_id="s1")
    assert result.ok and result.loops_detected == 1


async def test_no_state_change_is_a_loop() -> None:
    model = ScriptedModel(
        [call("get_weather", {"city": f"city {i}"}) for i in range(10)], repeat_last=True
    )
    hooks = LoopHooks(state_fingerprint=lambda: "same")
    guards = GuardConfig(max_steps_without_progress=2)
    result = await ToolLoop(model, REGISTRY, guards=guards, hooks=hooks).arun(USER, session_id="s")
    assert result.status == "loop_detected"
    assert any("state unchanged" in line for line in result.error.evidence)  # type: ignore[union-attr]
    assert result.steps[0].state_fingerprint == "same"


async def test_step_limit_reverts_and_answers_cleanly() -> None:
    reverted: list[Exception] = []
    model = ScriptedModel([call("get_weather", {"city": f"c{i}"}) for i in range(20)])
    loop = ToolLoop(
        model,
        REGISTRY,
        guards=GuardConfig(max_steps=3),
        hooks=LoopHooks(revert_to_last_good=reverted.append),
    )
    result = await loop.arun(USER, session_id="s1")
    assert result.status == "step_limit" and len(model.calls) == 3
    assert isinstance(result.error, StepLimitError) and reverted == [result.error]
    assert result.text.startswith("I'm sorry, I could not finish this")
    with pytest.raises(StepLimitError):
        result.raise_for_status()


async def test_time_limit_ends_the_run_even_inside_a_slow_tool() -> None:
    @tool
    async def crawl(url: str) -> str:
        """Crawl a site."""
        await asyncio.sleep(10)
        return url

    reverted: list[Exception] = []
    model = ScriptedModel([call("crawl", {"url": "x"})])
    guards = GuardConfig(run_timeout_s=0.2, tool_timeout_s=5)
    loop = ToolLoop(
        model,
        ToolRegistry([crawl]),
        guards=guards,
        hooks=LoopHooks(revert_to_last_good=reverted.append),
    )
    started = asyncio.get_running_loop().time()
    result = await loop.arun(USER, session_id="s1")
    assert asyncio.get_running_loop().time() - started < 2
    assert result.status == "time_limit" and isinstance(result.error, TimeLimitError)
    assert reverted and result.steps[-1].action == "stopped"
    assert_calls_answered(result)


async def test_model_call_timeout_then_recovery() -> None:
    slow_once: list[int] = []

    class Flaky(ScriptedModel):
        async def _acomplete(self, messages, tools, options):  # type: ignore[no-untyped-def]
            if not slow_once:
                slow_once.append(1)
                await asyncio.sleep(10)
            return await super()._acomplete(messages, tools, options)

    model = Flaky(["Here you go."])
    loop = ToolLoop(model, REGISTRY, guards=GuardConfig(model_timeout_s=0.05))
    result = await loop.arun(USER, session_id="s1")
    assert result.ok
    assert result.steps[0].action == "retry" and result.steps[0].error_type == "ModelTimeoutError"


async def test_persistent_model_failure_ends_the_run() -> None:
    model = ScriptedModel([ModelUnavailableError("503")], repeat_last=True)
    result = await ToolLoop(model, REGISTRY).arun(USER, session_id="s1")
    assert result.status == "model_failed" and isinstance(result.error, ModelUnavailableError)
    assert len(model.calls) == 2
    hanging = ScriptedModel(["never"], delay_s=5)
    result = await ToolLoop(hanging, REGISTRY, guards=GuardConfig(model_timeout_s=0.02)).arun(
        USER, session_id="s1"
    )
    assert result.status == "model_failed" and isinstance(result.error, ModelTimeoutError)


def _completion(text: str, finish: str = "stop") -> Completion:
    return Completion(
        message=Message.assistant(text),
        finish_reason=finish,  # type: ignore[arg-type]
        usage=Usage(prompt_tokens=10, completion_tokens=5),
        model="scripted",
        latency_ms=1,
    )


async def test_truncated_and_empty_replies_get_a_corrective_retry() -> None:
    # Stopped mid-sentence without reaching the token limit: not an answer to continue.
    model = ScriptedModel([_completion("The flight leaves at"), "", "Done."])
    result = await ToolLoop(model, REGISTRY, guards=GuardConfig(max_model_failures=3)).arun(
        USER, session_id="s1"
    )
    assert result.ok and result.text == "Done."
    corrections = [m for m in model.calls[2].messages if m.metadata.get("keel_correction")]
    assert [m.metadata["keel_correction"] for m in corrections] == ["truncated", "empty"]
    assert result.steps[0].error_type == "TruncatedResponseError"
    assert "The flight leaves at" not in [m.content for m in result.messages]


class Booking(BaseModel):
    flight: str
    seats: int


async def test_structured_output_gets_a_bounded_number_of_corrective_retries() -> None:
    model = ScriptedModel(['{"flight": "AF1"}', '{"flight": "AF1", "seats": 2}'])
    result = await ToolLoop(model, REGISTRY, output_schema=Booking).arun(USER, session_id="s1")
    assert result.ok and result.output == Booking(flight="AF1", seats=2)
    correction = model.calls[1].messages[-1]
    assert "Field 'seats': Field required" in correction.content
    for retries in (0, 1, 3):
        model = ScriptedModel(['{"flight": "AF1"}'], repeat_last=True)
        guards = GuardConfig(max_output_retries=retries)
        result = await ToolLoop(model, REGISTRY, output_schema=Booking, guards=guards).arun(
            USER, session_id="s1"
        )
        assert result.status == "invalid_output" and len(model.calls) == retries + 1
        assert isinstance(result.error, MalformedResponseError)


class BookingDict(TypedDict):
    flight: str
    seats: int


async def test_structured_output_may_be_a_typed_dict() -> None:
    model = ScriptedModel(['{"flight": "AF1", "seats": "two"}', '{"flight": "AF1", "seats": 2}'])
    result = await ToolLoop(model, REGISTRY, output_schema=BookingDict).arun(USER, session_id="s1")
    assert result.ok and result.output == {"flight": "AF1", "seats": 2}
    assert "Field 'seats'" in model.calls[1].messages[-1].content


async def test_hooks_see_every_step_and_can_replace_the_prompt() -> None:
    prompts: list[tuple[int, int]] = []
    records: list[StepRecord] = []

    async def before(step: int, messages: list[Message]) -> list[Message]:
        prompts.append((step, len(messages)))
        return [Message.system("compiled"), messages[-1]]

    model = ScriptedModel([call("get_weather", {"city": "Oslo"}), "Sunny."])
    loop = ToolLoop(
        model, REGISTRY, hooks=LoopHooks(before_model_call=before, after_step=records.append)
    )
    result = await loop.arun(USER, session_id="s1", first_step=10)
    assert result.ok
    assert prompts == [(10, 2), (11, 4)]
    assert [r.step for r in records] == [10, 11] == [s.step for s in result.steps]
    assert result.next_step == 12
    assert model.calls[0].messages[0].content == "compiled" and len(model.calls[1].messages) == 2


async def test_in_doubt_side_effect_escalates_and_resume_replays_the_decision() -> None:
    journal = InMemoryJournal()
    crash = RuntimeError("process died")

    class Crash(BaseException):
        pass

    crashing: list[bool] = [True]

    @tool(side_effect=True, idempotent=False)
    def charge(amount: int) -> str:
        """Charge the card."""
        booked.append(f"charge {amount}")
        if crashing[0]:
            raise Crash(crash)
        return "charged"

    registry = ToolRegistry([charge])
    model = ScriptedModel([call("charge", {"amount": 5}), "Charged."])
    with pytest.raises(Crash):
        await ToolLoop(model, registry, journal=journal).arun(USER, session_id="s9")
    assert [e.in_doubt for e in journal.entries("s9")] == [True]
    crashing[0] = False
    # A fresh model that would now ask for something else: the journalled decision wins.
    fresh = ScriptedModel([call("charge", {"amount": 999}), "Charged."])
    result = await ToolLoop(fresh, registry, journal=journal).arun(USER, session_id="s9")
    assert result.status == "tool_in_doubt" and isinstance(result.error, ToolInDoubtError)
    assert booked == ["charge 5"] and fresh.calls == []
    assert result.steps[0].replayed_decision
    assert "A person will check it" in result.text
    assert_calls_answered(result)
    # The operator checks by hand and records the outcome; the resumed run goes on.
    journal.resolve(journal.in_doubt("s9")[0].key, ok=True, content="charged (checked)")
    after = ScriptedModel(["Charged."])
    result = await ToolLoop(after, registry, journal=journal).arun(USER, session_id="s9")
    assert result.ok and booked == ["charge 5"] and len(after.calls) == 1
    assert result.steps[0].tool_results[0].replayed


async def test_model_sees_the_schema_of_every_tool() -> None:
    def policy(call_: ScriptedCall) -> str:
        return ",".join(t["function"]["name"] for t in call_.tools)

    result = await ToolLoop(ScriptedModel(policy), REGISTRY).arun(USER, session_id="s1")
    assert result.text == "book_flight,get_weather,lookup"


def test_a_hung_sync_tool_does_not_hold_the_run_or_the_process() -> None:
    import threading
    import time

    release = threading.Event()

    @tool(timeout_s=0.05)
    def stuck(path: str) -> str:
        """Read a file from a network share that hangs."""
        release.wait(30)
        return path

    model = ScriptedModel([call("stuck", {"path": "/x"}), "The share is not answering."])
    started = time.perf_counter()
    result = ToolLoop(model, ToolRegistry([stuck])).run(USER, session_id="s1")
    elapsed = time.perf_counter() - started
    release.set()
    assert result.ok and result.steps[0].tool_results[0].status == "timeout"
    assert elapsed < 5  # asyncio.run did not wait for the hung thread


async def test_tools_can_be_given_as_a_list() -> None:
    def add(a: int, b: int) -> int:
        """Add two numbers."""
        return a + b

    model = ScriptedModel([call("add", {"a": 2, "b": "3"}), "5"])
    result = await ToolLoop(model, [add, get_weather]).arun(USER, session_id="s1")
    assert result.ok and result.steps[0].tool_results[0].content == "5"
    assert ToolLoop(model).registry.names == []


async def test_results_serialize_for_traces_whatever_the_tools_return() -> None:
    class Opaque:
        def __str__(self) -> str:
            return "opaque-object"

    @tool
    def fetch(key: str) -> Opaque:
        """Fetch an object."""
        return Opaque()

    model = ScriptedModel([call("fetch", {"key": "k"}), "Fetched."])
    result = await ToolLoop(model, [fetch]).arun(USER, session_id="s1")
    dumped = json.loads(result.model_dump_json())
    assert dumped["steps"][0]["tool_results"][0]["output"] == "opaque-object"
    assert dumped["status"] == "completed" and "error" not in dumped
    assert LoopResult.model_fields["error"].exclude
