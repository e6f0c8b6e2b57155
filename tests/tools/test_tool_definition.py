"""@tool: typed functions become tools with schemas, descriptions and declared effects."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Annotated, Literal

import pytest
from pydantic import BaseModel, Field

from keel.errors import ToolDefinitionError
from keel.tools import NestedArgumentsWarning, Tool, ToolContext, ToolRegistry, tool


@tool
def book_flight(
    flight: str,
    passengers: Annotated[int, Field(ge=1, description="How many seats to book.")],
    cabin: Literal["economy", "business"] = "economy",
) -> str:
    """Book seats on a flight.

    Longer explanation that stays in the description.

    Args:
        flight: The flight number,
            for example "AF123".
        passengers: This docstring line loses to the Annotated description.
        cabin: Which cabin.

    Returns:
        A booking reference.
    """
    return f"{flight}:{passengers}:{cabin}"


def test_schema_is_in_the_openai_tools_format() -> None:
    schema = book_flight.schema()
    assert schema["type"] == "function"
    function = schema["function"]
    assert function["name"] == "book_flight"
    assert function["description"].startswith("Book seats on a flight.")
    assert "Longer explanation" in function["description"]
    assert "Returns" not in function["description"]
    parameters = function["parameters"]
    assert parameters["type"] == "object"
    assert parameters["required"] == ["flight", "passengers"]
    assert parameters["additionalProperties"] is False
    properties = parameters["properties"]
    assert properties["flight"] == {
        "type": "string",
        "description": 'The flight number, for example "AF123".',
    }
    assert properties["passengers"]["description"] == "How many seats to book."
    assert properties["passengers"]["minimum"] == 1
    assert properties["cabin"]["enum"] == ["economy", "business"]
    assert properties["cabin"]["description"] == "Which cabin."
    assert "title" not in parameters and "title" not in properties["flight"]


def test_a_tool_stays_callable_as_the_function() -> None:
    assert isinstance(book_flight, Tool)
    assert book_flight("AF1", 2) == "AF1:2:economy"
    assert book_flight.side_effect is False and book_flight.idempotent is True


def test_side_effects_default_to_not_idempotent() -> None:
    @tool(side_effect=True, timeout_s=5, max_output_chars=100, name="pay")
    async def charge(amount: float) -> str:
        """Charge the card."""
        return "paid"

    assert charge.name == "pay"
    assert charge.side_effect is True and charge.idempotent is False
    assert charge.timeout_s == 5 and charge.max_output_chars == 100
    assert charge.is_async
    args = charge.args_model(amount=3)
    assert asyncio.run(charge.ainvoke(args)) == "paid"


def test_context_parameter_is_injected_and_hidden_from_the_model() -> None:
    seen: list[ToolContext | None] = []

    @tool(side_effect=True)
    def send(text: str, ctx: ToolContext | None = None) -> str:
        """Send a message."""
        seen.append(ctx)
        return text

    assert list(send.schema()["function"]["parameters"]["properties"]) == ["text"]
    context = ToolContext("s", 1, 0, "call_1", "keel-abc")
    assert asyncio.run(send.ainvoke(send.args_model(text="hi"), context)) == "hi"
    assert seen == [context]


def test_every_spelling_of_a_context_parameter_is_keels_not_the_models() -> None:
    from typing import Optional

    @dataclass
    class Deps:
        name: str

    def plain(text: str, ctx: ToolContext) -> str:
        """One."""
        return text

    def typed(text: str, ctx: ToolContext[Deps]) -> str:
        """Two."""
        return ctx.deps.name

    def optional(text: str, ctx: Optional[ToolContext[Deps]] = None) -> str:  # noqa: UP045
        """Three."""
        return text

    def union(text: str, ctx: ToolContext[Deps] | None = None) -> str:
        """Four."""
        return text

    for function in (plain, typed, optional, union):
        defined = tool(function)
        assert list(defined.schema()["function"]["parameters"]["properties"]) == ["text"]
    context = ToolContext("s", 1, 0, "call_1", "keel-abc", deps=Deps("ada"))
    assert asyncio.run(tool(typed).ainvoke(tool(typed).args_model(text="x"), context)) == "ada"


def test_nested_arguments_warn_and_show_the_flat_form() -> None:
    class Passenger(BaseModel):
        name: str
        age: int

    with pytest.warns(NestedArgumentsWarning) as caught:

        @tool
        def add_passengers(flight: str, passengers: list[Passenger]) -> str:
            """Add passengers to a booking."""
            return flight

    text = str(caught[0].message)
    assert "passengers" in text
    assert (
        "def add_passengers(flight: str, passengers_name: list[str], passengers_age: list[int])"
        in text
    )
    assert add_passengers.nested_fields == ("passengers",)


@pytest.mark.parametrize(
    ("source", "needle"),
    [
        ("def f(*args: int) -> str:\n    '''Doc.'''\n    return ''", "*args"),
        ("def f(x) -> str:\n    '''Doc.'''\n    return ''", "no type annotation"),
        ("def f(x: int) -> str:\n    return ''", "no description"),
        ("def f(x: int, /) -> str:\n    '''Doc.'''\n    return ''", "positional-only"),
    ],
)
def test_functions_that_cannot_be_tools_are_refused(source: str, needle: str) -> None:
    namespace: dict[str, object] = {}
    exec(source, namespace)
    with pytest.raises(ToolDefinitionError, match=needle.replace("*", r"\*")):
        tool(namespace["f"])  # type: ignore[call-overload]


def test_invalid_name_and_duplicates_are_refused() -> None:
    with pytest.raises(ToolDefinitionError, match="invalid"):
        tool(name="has space")(lambda: "")
    registry = ToolRegistry([book_flight])
    with pytest.raises(ToolDefinitionError, match="already registered"):
        registry.register(book_flight)


def test_registry_accepts_plain_functions_and_suggests_close_names() -> None:
    def get_weather(city: str) -> str:
        """Weather in a city."""
        return city

    registry = ToolRegistry([book_flight, get_weather])
    assert registry.names == ["book_flight", "get_weather"]
    assert [s["function"]["name"] for s in registry.schemas()] == registry.names
    assert registry.suggest("bookflight") == ["book_flight"]
    assert registry.suggest("Get_Weather")[0] == "get_weather"
    assert registry.suggest("weather") == ["get_weather"]
    assert registry.suggest("zzzz") == []
    assert "get_weather" in registry and len(registry) == 2


async def test_sync_tools_reuse_an_idle_thread_and_a_hung_one_blocks_no_other() -> None:
    import threading

    from keel._bridge import _own_threads, _OwnThreads

    release = threading.Event()

    @tool
    def where() -> int:
        """Say which thread runs the tool."""
        return threading.get_ident()

    @tool
    def hang() -> str:
        """Wait until released."""
        release.wait(10)
        return "released"

    assert isinstance(_own_threads, _OwnThreads)
    first = await where.ainvoke(where.args_model())
    second = await where.ainvoke(where.args_model())
    assert first == second, "an idle tool thread was not reused"
    hung = asyncio.ensure_future(hang.ainvoke(hang.args_model()))
    await asyncio.sleep(0.05)
    # The hung call holds its thread; the next call gets another one and does not wait.
    await asyncio.wait_for(where.ainvoke(where.args_model()), 5)
    assert not hung.done()
    release.set()
    assert await hung == "released"
