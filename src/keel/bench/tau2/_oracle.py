"""The agent's model in ``keel bench tau2``: a scripted "grounded oracle".

It knows the task's gold tool calls and follows them in order, but every value it passes is
copied from what it can see in its prompt: the text itself, or the placeholder keel showed in
its place (which placeholder stands for which value it learns by lining the masked text up
with the text it knows was said: the customer's words, or what a lookup returns). A value it
cannot find is never invented: when a lookup would show it (the customer's profile, an order,
a product), it makes that lookup first, as an agent would; when none would, the call is
skipped and counted in `GroundedOracle.ungrounded`. It asks the customer to confirm each
write before making it, and answers once the calls are done.

The oracle decides from the prompt alone (which calls it already made, what the customer
confirmed), so a fresh one in a new process continues where a killed one stopped.
"""

from __future__ import annotations

import copy
import importlib
import json
import re
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from keel.bench.tau2._data import PACKAGE, GoldAction, Task
from keel.messages import Message
from keel.testing import ScriptedCall, ScriptedModel

__all__ = ["CONFIRM", "FINAL", "GroundedOracle", "Grounding", "attribute_placeholders"]

CONFIRM = "Shall I proceed? Please answer yes or no."
"""How every confirmation request ends (the scripted customer answers it)."""

FINAL = "That is everything you asked for, done. Is there anything else I can help with?"
"""The oracle's last answer: the conversation is over."""

_PLACEHOLDER = re.compile(r"<[A-Z][A-Z0-9_]*_\d+>")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")
_CONTEXT = 24
"""Characters of text around a placeholder used to find the value it replaced."""
_US_STATES = dict(
    pair.split("=")
    for pair in [
        "AL=Alabama",
        "AK=Alaska",
        "AZ=Arizona",
        "AR=Arkansas",
        "CA=California",
        "CO=Colorado",
        "CT=Connecticut",
        "DE=Delaware",
        "FL=Florida",
        "GA=Georgia",
        "HI=Hawaii",
        "ID=Idaho",
        "IL=Illinois",
        "IN=Indiana",
        "IA=Iowa",
        "KS=Kansas",
        "KY=Kentucky",
        "LA=Louisiana",
        "ME=Maine",
        "MD=Maryland",
        "MA=Massachusetts",
        "MI=Michigan",
        "MN=Minnesota",
        "MS=Mississippi",
        "MO=Missouri",
        "MT=Montana",
        "NE=Nebraska",
        "NV=Nevada",
        "NH=New Hampshire",
        "NJ=New Jersey",
        "NM=New Mexico",
        "NY=New York",
        "NC=North Carolina",
        "ND=North Dakota",
        "OH=Ohio",
        "OK=Oklahoma",
        "OR=Oregon",
        "PA=Pennsylvania",
        "RI=Rhode Island",
        "SC=South Carolina",
        "SD=South Dakota",
        "TN=Tennessee",
        "TX=Texas",
        "UT=Utah",
        "VT=Vermont",
        "VA=Virginia",
        "WA=Washington",
        "WV=West Virginia",
        "WI=Wisconsin",
        "WY=Wyoming",
        "DC=Washington DC",
    ]
)
"""US states by postal code: a model writes ``NY`` for "New York" without being told."""
_UNSETTLED = ("in doubt", "may or may not have taken effect", "unknown whether it took effect")
"""How keel tells the model a call's outcome is unknown: the oracle asks for it again (keel
must answer with what an operator recorded, never run it twice)."""
_LOOKUPS = 2
"""How often the oracle makes one lookup: again when the first result left its prompt."""
_FREE_TEXT = frozenset({("transfer_to_human_agents", "summary")})
"""Arguments the model writes in its own words (nothing to copy)."""


def _server() -> Any:
    # The package's own tool functions simulate what a lookup returns (the bench extra).
    return importlib.import_module(f"{PACKAGE}.server")


def attribute_placeholders(masked: str, raw_texts: Sequence[str]) -> dict[str, str]:
    """Which value each placeholder in ``masked`` replaced, found by lining the text around it
    up with the texts the oracle knows were said (``raw_texts``)."""
    whole = _whole_alignment(masked, raw_texts)
    if whole:
        return whole
    found: dict[str, str] = {}
    for match in _PLACEHOLDER.finditer(masked):
        before = _PLACEHOLDER.split(masked[: match.start()])[-1][-_CONTEXT:]
        after = _PLACEHOLDER.split(masked[match.end() :])[0][:_CONTEXT]
        if not before and not after:
            continue
        pattern = re.compile(re.escape(before) + r"(.+?)" + re.escape(after), re.DOTALL)
        for raw in raw_texts:
            hit = pattern.search(raw)
            if hit is not None and not _PLACEHOLDER.fullmatch(hit.group(1)):
                found.setdefault(match.group(0), hit.group(1))
                break
    return found


def _whole_alignment(masked: str, raw_texts: Sequence[str]) -> dict[str, str]:
    """Placeholders read off a known text that ``masked`` is a masking of, whole (several
    placeholders side by side are told apart only so)."""
    literals = _PLACEHOLDER.split(masked)
    names = _PLACEHOLDER.findall(masked)
    pattern = re.compile("(.+?)".join(re.escape(literal) for literal in literals), re.DOTALL)
    for raw in raw_texts:
        hit = pattern.fullmatch(raw)
        if hit is not None:
            return dict(zip(names, hit.groups(), strict=True))
    return {}


class Grounding:
    """What the oracle can see in one prompt: its text and the placeholders it can read."""

    def __init__(self, text: str, placeholders: dict[str, str]) -> None:
        self.text = text
        self.placeholders = placeholders

    def exact(self, value: str) -> str | None:
        """``value`` as the prompt shows it (itself or its placeholder), or None."""
        if value in self.text:
            return value
        for placeholder, raw in self.placeholders.items():
            if raw == value and placeholder in self.text:
                return placeholder
        return None

    def known(self, value: str) -> str | None:
        """A state's postal code, when the prompt names the state (what any model knows)."""
        name = _US_STATES.get(value)
        return value if name is not None and name.lower() in self.text.lower() else None

    def loose(self, value: str) -> str | None:
        """``value`` written otherwise (another case), as a whole word of the prompt."""
        pattern = r"(?<![A-Za-z0-9])" + re.escape(value) + r"(?![A-Za-z0-9])"
        hit = re.search(pattern, self.text, re.IGNORECASE)
        return hit.group(0) if hit else None

    def expression(self, expression: str) -> bool:
        """A sum the model writes itself: every number in it is in the prompt."""
        return all(number in self.text for number in _NUMBER.findall(expression))


def _copy(seen: Grounding, value: str) -> str | None:
    return seen.exact(value) or seen.known(value) or seen.loose(value)


def _values(arguments: dict[str, Any], name: str) -> Iterator[str]:
    for key, value in arguments.items():
        if (name, key) in _FREE_TEXT or name == "calculate":
            continue
        for item in value if isinstance(value, list) else [value]:
            if isinstance(item, str):
                yield item


def _canonical(name: str, arguments: dict[str, Any]) -> str:
    return name + json.dumps(arguments, sort_keys=True)


class GroundedOracle(ScriptedModel):
    """A [`ScriptedModel`][] whose replies come from `decide`.

    Args:
        task: the task whose gold calls it follows.
        customer_texts: what the customer said, unmasked (to read placeholders in it).
        record: a file the oracle appends the indexes of gold calls it could not ground to
            (so a run that spans processes counts each once).
    """

    def __init__(
        self, task: Task, customer_texts: Sequence[str], *, record: Path | None = None
    ) -> None:
        super().__init__(self.decide)
        self.task = task
        self.customer_texts = list(customer_texts)
        self.record = record
        self.ungrounded: set[int] = set()
        self._applied: list[tuple[str, dict[str, Any]]] = []
        self._db: dict[str, Any] = copy.deepcopy(_server()._base_db())
        self.user = self._customer_id()

    # --- what the oracle knows about the store ------------------------------------------------

    def _customer_id(self) -> str | None:
        db = self._db
        for action in self.task.actions:
            args = action.arguments
            if args.get("user_id") in db["users"]:
                return str(args["user_id"])
            if args.get("order_id") in db["orders"]:
                return str(db["orders"][args["order_id"]]["user_id"])
        return None

    def _simulate(self, name: str, arguments: dict[str, Any]) -> str:
        """What the server returns for this call now (the store as the calls so far left it)."""
        server = _server()
        try:
            return str(server._content_from_result(server._execute_tool(self._db, name, arguments)))
        except Exception as exc:
            return f"Error: {exc}"

    def _replay(self, made: list[tuple[str, dict[str, Any]]]) -> None:
        """Bring the simulated store up to the calls the prompt shows (each write once)."""
        if made[: len(self._applied)] != self._applied:
            self._db = copy.deepcopy(_server()._base_db())
            self._applied = []
        seen = {_canonical(n, a) for n, a in self._applied}
        for name, arguments in made[len(self._applied) :]:
            if _canonical(name, arguments) not in seen or name == "calculate":
                self._simulate(name, arguments)
                seen.add(_canonical(name, arguments))
            self._applied.append((name, arguments))

    def _lookups(self) -> Iterator[tuple[str, dict[str, Any]]]:
        """The reads that show the customer's data, in the order an agent would make them."""
        if self.user is None:
            return
        user = self._db["users"][self.user]
        name = user["name"]
        yield "find_user_id_by_email", {"email": user["email"]}
        yield (
            "find_user_id_by_name_zip",
            {
                "first_name": name["first_name"],
                "last_name": name["last_name"],
                "zip": user["address"]["zip"],
            },
        )
        yield "get_user_details", {"user_id": self.user}
        for order_id in user["orders"]:
            yield "get_order_details", {"order_id": order_id}
        products = {
            item["product_id"]
            for order_id in user["orders"]
            for item in self._db["orders"][order_id]["items"]
        }
        for product_id in sorted(products):
            yield "get_product_details", {"product_id": product_id}

    # --- the decision ---------------------------------------------------------------------------

    def decide(self, call: ScriptedCall) -> Message | str:
        messages = list(call.messages)
        made, done = _calls_made(messages)
        self._replay(made)
        seen = self._grounding(messages, made)
        unused = list(done)
        for index, action in enumerate(self.task.actions):
            lookup = self._lookup_for(action, seen, made)
            if lookup is not None:
                return _call(len(made), *lookup)
            arguments = self._ground(action, seen)
            if arguments is None:
                self._ungrounded(index)
                continue
            made_before = next(
                (at for at, call in enumerate(unused) if _same_call(call, action.name, arguments)),
                None,
            )
            if made_before is not None:
                del unused[made_before]
                continue
            if action.writes and not _confirmed(messages, index):
                return _confirmation(index, action.name, arguments)
            return _call(len(made), action.name, arguments)
        return FINAL

    def _grounding(
        self, messages: list[Message], made: list[tuple[str, dict[str, Any]]]
    ) -> Grounding:
        text = "\n".join(m.content for m in messages if m.content)
        raw = [*self.customer_texts, *(self._simulate(n, a) for n, a in made)]
        placeholders: dict[str, str] = {}
        for message in messages:
            if message.content and _PLACEHOLDER.search(message.content):
                for placeholder, value in attribute_placeholders(message.content, raw).items():
                    placeholders.setdefault(placeholder, value)
        return Grounding(text, placeholders)

    def _ground(self, action: GoldAction, seen: Grounding) -> dict[str, Any] | None:
        """The gold call's arguments as the prompt shows them; None when one is not there."""
        if action.name == "calculate":
            expression = str(action.arguments.get("expression", ""))
            return dict(action.arguments) if seen.expression(expression) else None
        grounded: dict[str, Any] = {}
        for key, value in action.arguments.items():
            if (action.name, key) in _FREE_TEXT or not isinstance(value, str | list):
                grounded[key] = value
                continue
            items = value if isinstance(value, list) else [value]
            copied = [_copy(seen, v) if isinstance(v, str) else v for v in items]
            if any(v is None for v in copied):
                return None
            grounded[key] = copied if isinstance(value, list) else copied[0]
        return grounded

    def _lookup_for(
        self,
        action: GoldAction,
        seen: Grounding,
        made: list[tuple[str, dict[str, Any]]],
        depth: int = 3,
    ) -> tuple[str, dict[str, Any]] | None:
        """The first read to make so that a value of ``action`` the prompt lacks shows up."""
        for value in _values(action.arguments, action.name):
            if seen.exact(value) is not None:
                continue
            for name, arguments in self._lookups():
                if value not in self._simulate(name, arguments):
                    continue
                needed = GoldAction(name, arguments)
                shown = self._ground(needed, seen)
                if shown is not None:
                    # Once more when keel's context has trimmed an older result; not again.
                    if sum(_same_call(call, name, shown) for call in made) < _LOOKUPS:
                        return name, shown
                    continue
                deeper = self._lookup_for(needed, seen, made, depth - 1) if depth else None
                if deeper is not None:
                    return deeper
        return None

    def _ungrounded(self, index: int) -> None:
        if index in self.ungrounded:
            return
        self.ungrounded.add(index)
        if self.record is not None:
            with self.record.open("a") as out:
                out.write(f"{index}\n")


def _same_call(made: tuple[str, dict[str, Any]], name: str, arguments: dict[str, Any]) -> bool:
    """Whether a call the prompt shows is the call ``name(arguments)``: each argument as
    written, or a placeholder keel showed in its place (keel masks what a model's own
    arguments hold, a name after "first_name", that the customer's words did not show as
    one)."""
    made_name, made_arguments = made
    return (
        made_name == name
        and made_arguments.keys() == arguments.keys()
        and all(_same_value(made_arguments[key], value) for key, value in arguments.items())
    )


def _same_value(made: Any, value: Any) -> bool:
    if isinstance(made, list) and isinstance(value, list):
        return len(made) == len(value) and all(map(_same_value, made, value))
    if isinstance(made, str) and isinstance(value, str) and _PLACEHOLDER.fullmatch(made):
        return True
    return bool(made == value)


def _calls_made(
    messages: list[Message],
) -> tuple[list[tuple[str, dict[str, Any]]], list[tuple[str, dict[str, Any]]]]:
    """The calls in the prompt, in order, and those that got an answer that is not an
    in-doubt notice (those are done; one in doubt is asked again)."""
    results = {m.tool_call_id: m.content for m in messages if m.role == "tool"}
    made: list[tuple[str, dict[str, Any]]] = []
    done: list[tuple[str, dict[str, Any]]] = []
    for message in messages:
        for tool_call in message.tool_calls:
            try:
                arguments = json.loads(tool_call.arguments or "{}")
            except json.JSONDecodeError:
                continue
            made.append((tool_call.name, arguments))
            result = results.get(tool_call.id)
            if result is not None and not any(words in result for words in _UNSETTLED):
                done.append((tool_call.name, arguments))
    return made, done


def _marker(index: int) -> str:
    return f"(action {index + 1})"


def _confirmed(messages: list[Message], index: int) -> bool:
    """The customer answered yes after the oracle asked about gold call ``index``."""
    asked = False
    for message in messages:
        if message.role == "assistant" and _marker(index) in message.content:
            asked = True
        elif asked and message.role == "user" and message.content.strip().lower() == "yes":
            return True
    return False


def _confirmation(index: int, name: str, arguments: dict[str, Any]) -> str:
    return f"Before I go ahead {_marker(index)}: {name} {json.dumps(arguments)}. {CONFIRM}"


def _call(position: int, name: str, arguments: dict[str, Any]) -> Message:
    # Ids by position in the conversation: a new process numbers its calls on from the
    # history, never reusing an id its predecessor used.
    return ScriptedModel.tool_call(name, json.dumps(arguments), call_id=f"call_{position + 1}")
