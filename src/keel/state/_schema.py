"""A state schema: the typed shape of a session's state, its reducers, version and migrations.

State is either a Pydantic v2 model or a ``TypedDict`` (graph-style state). The schema turns
values to and from JSON, applies updates through each field's reducer, validates at every
boundary, and migrates stored data written by an older version of the schema. Stored data is
never completed with silent defaults: a stored state that lacks a field of the current schema
(or has one the schema no longer knows) fails loudly unless a migration says what to do.
"""

from __future__ import annotations

import operator
import typing
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast, get_args, get_origin, get_type_hints

import typing_extensions
from pydantic import BaseModel, TypeAdapter, ValidationError

from keel.errors import StateDefinitionError, StateMigrationError, StateValidationError
from keel.state._agent_state import AgentState
from keel.state._reducers import Reducer, find_reducer, overwrite

__all__ = ["JSONState", "StateMigration", "StateSchema"]

S = TypeVar("S")

_WRAPPERS = (
    typing.Required,
    typing.NotRequired,
    typing_extensions.Required,
    typing_extensions.NotRequired,
)

JSONState = dict[str, Any]
"""A state as plain JSON data: field name -> JSON value."""

StateMigration = Callable[[JSONState], JSONState]
"""Turns stored JSON data of schema version N into version N + 1."""


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(part) for part in error['loc']) or 'state'}: {error['msg']}"
        for error in exc.errors()
    )


@dataclass(frozen=True)
class _Field:
    name: str
    reducer: Reducer
    required: bool


class StateSchema(Generic[S]):
    """The schema of a state type, with its reducers, version and migrations.

    Args:
        state_type: a Pydantic ``BaseModel`` subclass or a ``TypedDict`` (on Python 3.11 use
            ``typing_extensions.TypedDict``, which Pydantic requires).
        name: the name stored with every checkpoint (default: the class name). Loading a
            session written under another name fails, so two state types never mix.
        version: the schema version (>= 1). Bump it whenever fields change and register a
            migration from the previous version.
        migrations: ``{from_version: function}``, each turning JSON data of ``from_version``
            into ``from_version + 1``.

    Raises:
        StateDefinitionError: not a model or TypedDict, a bad version, or a reducer problem.
    """

    def __init__(
        self,
        state_type: type[S],
        *,
        name: str | None = None,
        version: int = 1,
        migrations: Mapping[int, StateMigration] | None = None,
    ) -> None:
        if version < 1:
            raise StateDefinitionError(f"schema version must be >= 1, got {version}")
        self.state_type = state_type
        self.name: str = name or str(getattr(state_type, "__name__", "State"))
        self.version = version
        self._migrations: dict[int, StateMigration] = dict(migrations or {})
        for source in self._migrations:
            if not 1 <= source < version:
                raise StateDefinitionError(
                    f"{self.name}: a migration from version {source} cannot exist when the "
                    f"current version is {version}"
                )
        self.is_model = isinstance(state_type, type) and issubclass(state_type, BaseModel)
        self.fields: dict[str, _Field] = {}
        if self.is_model:
            model = cast(type[BaseModel], state_type)
            for field_name, info in model.model_fields.items():
                try:
                    found = find_reducer(info.metadata)
                except TypeError as exc:
                    raise StateDefinitionError(f"{self.name}.{field_name}: {exc}") from exc
                self.fields[field_name] = _Field(field_name, found or overwrite, info.is_required())
            self._adapter: TypeAdapter[Any] | None = None
            self.extensible_lists = _extensible_lists(model)
        elif typing_extensions.is_typeddict(state_type):
            try:
                self._adapter = TypeAdapter(state_type)
            except Exception as exc:
                raise StateDefinitionError(
                    f"{self.name}: cannot build a validator for this TypedDict ({exc}); on "
                    "Python 3.11 declare it with typing_extensions.TypedDict"
                ) from exc
            hints = get_type_hints(state_type, include_extras=True)
            # __required_keys__ is wrong under postponed annotations: decide from the hints.
            total = bool(getattr(state_type, "__total__", True))
            for field_name, hint in hints.items():
                metadata: tuple[Any, ...] = ()
                required = total
                # Required[...] / NotRequired[...] may wrap the Annotated.
                while get_origin(hint) in _WRAPPERS:
                    required = get_origin(hint) in (typing.Required, typing_extensions.Required)
                    hint = get_args(hint)[0]
                if get_origin(hint) is typing.Annotated:
                    metadata = tuple(getattr(hint, "__metadata__", ()))
                try:
                    found = find_reducer(metadata)
                except TypeError as exc:
                    raise StateDefinitionError(f"{self.name}.{field_name}: {exc}") from exc
                self.fields[field_name] = _Field(field_name, found or overwrite, required)
            self.extensible_lists = frozenset()
        else:
            raise StateDefinitionError(
                f"state type {state_type!r} must be a Pydantic BaseModel subclass or a TypedDict"
            )

    def migration(self, from_version: int) -> Callable[[StateMigration], StateMigration]:
        """Register a migration from ``from_version`` to the next version, as a decorator."""
        if not 1 <= from_version < self.version:
            raise StateDefinitionError(
                f"{self.name}: no version {from_version + 1} to migrate to "
                f"(current version is {self.version})"
            )

        def register(fn: StateMigration) -> StateMigration:
            self._migrations[from_version] = fn
            return fn

        return register

    def reducer_of(self, field: str) -> Reducer:
        """The reducer that combines updates of ``field``."""
        return self.fields[field].reducer

    # --- validation and conversion ------------------------------------------------------------

    def validate(self, value: Any) -> S:
        """``value`` (a state, or a mapping of field values) as a validated state.

        Raises:
            StateValidationError: the value fails the schema; one problem per field.
        """
        try:
            if self.is_model:
                model = cast(type[BaseModel], self.state_type)
                if isinstance(value, model):
                    # Re-run the model's own validators (it may have been mutated since it was
                    # built); nested frozen models such as messages are reused, not re-parsed.
                    value = {name: getattr(value, name) for name in self.fields}
                return cast(S, model.model_validate(value))
            assert self._adapter is not None
            return cast(S, self._adapter.validate_python(value))
        except ValidationError as exc:
            raise StateValidationError(f"invalid {self.name} state: {_problems(exc)}") from exc

    def validate_extending(
        self, value: Any, previous: Mapping[str, list[Any]]
    ) -> tuple[S, dict[str, int]]:
        """``value`` validated as ``validate`` does, knowing the lists of a state validated before.

        ``previous`` maps list fields to their lists in a state this schema validated, each
        holding only immutable items (scalars, frozen models). A field of ``extensible_lists``
        whose list in ``value`` starts with the very objects of its ``previous`` list has only
        its new items validated: those objects cannot have changed, and nothing but the list's
        own item validation looks at that field, so the outcome is the one of validating the
        whole state, at a cost that grows with the new items only.

        Returns:
            The state, and for each such field the number of leading items taken as they were.

        Raises:
            StateValidationError: as ``validate`` (the same message, item indexes included).
        """
        if not self.extensible_lists:
            return self.validate(value), {}
        model = cast(type[BaseModel], self.state_type)
        if isinstance(value, model):
            fields = {name: getattr(value, name) for name in self.fields}
        elif isinstance(value, Mapping):
            fields = dict(value)
        else:
            return self.validate(value), {}
        kept: dict[str, int] = {}
        for name in self.extensible_lists:
            old, new = previous.get(name), fields.get(name)
            if (
                type(old) is list
                and type(new) is list
                and 0 < len(old) <= len(new)
                and all(map(operator.is_, old, new))
            ):
                kept[name] = len(old)
                fields[name] = new[len(old) :]
        if not kept:
            return self.validate(value), {}
        try:
            partial = model.model_validate(fields)
        except ValidationError:
            # Validating the whole state fails too; it reports the items' real indexes.
            return self.validate(value), {}
        # Every item is validated now: assembling the lists needs no validation again.
        whole = partial.model_copy(
            update={name: [*previous[name], *getattr(partial, name)] for name in kept}
        )
        return cast(S, whole), kept

    def validate_appending(
        self,
        values: Mapping[str, Any],
        append: Mapping[str, Sequence[Any]],
        update: Mapping[str, Any],
        unchanged: Collection[str],
    ) -> tuple[BaseModel, dict[str, list[Any]]] | None:
        """The fields of a state validated before (``values``, field -> value) with ``update``
        set and ``append``'s items added to those list fields, validated at a cost that grows
        with what is new: the lists' earlier items are not looked at.

        The fields of ``append`` and of ``unchanged`` (list fields taken as they are) must be
        ``extensible_lists`` holding only immutable items (the caller checks): those items
        cannot have changed, and nothing else in the model reads those fields.

        Returns:
            The state with those lists empty, and each appended field's new items validated;
            None when the result fails validation (validate the whole state then: it reports
            the items' real indexes).
        """
        model = cast(type[BaseModel], self.state_type)
        fields = dict(values)
        fields.update(update)
        for name in append:
            fields[name] = list(append[name])
        for name in unchanged:
            fields[name] = []
        try:
            partial = model.model_validate(fields)
        except ValidationError:
            return None
        return partial, {name: getattr(partial, name) for name in append}

    def to_json(self, state: S) -> JSONState:
        """The state as JSON data (field name -> JSON value)."""
        if self.is_model:
            return cast(BaseModel, state).model_dump(mode="json")
        assert self._adapter is not None
        return cast(JSONState, self._adapter.dump_python(state, mode="json"))

    def field_values(self, state: S) -> dict[str, Any]:
        """The state's Python field values (absent optional TypedDict keys are left out)."""
        if self.is_model:
            return {name: getattr(state, name) for name in self.fields}
        mapping = cast(Mapping[str, Any], state)
        return {name: mapping[name] for name in self.fields if name in mapping}

    def field_to_json(self, field: str, value: Any) -> Any:
        """One field's Python value as JSON."""
        if self.is_model:
            adapter = _field_adapter(cast(type[BaseModel], self.state_type), field)
        else:
            adapter = _typed_dict_field_adapter(self.state_type, field)
        return adapter.dump_python(value, mode="json")

    def apply(
        self,
        state: S,
        update: Mapping[str, Any],
        *,
        previous: Mapping[str, list[Any]] | None = None,
    ) -> S:
        """A new state: ``update``'s fields combined with ``state`` through their reducers.

        ``previous``, as in ``validate_extending``, lets appended lists be validated by their
        new items only.

        Raises:
            StateValidationError: an unknown field, a reducer that fails, or a result that
                fails the schema. ``state`` itself is never changed.
        """
        unknown = sorted(set(update) - set(self.fields))
        if unknown:
            raise StateValidationError(
                f"{self.name} has no field(s) {', '.join(unknown)}; fields: "
                f"{', '.join(self.fields)}"
            )
        values = self.field_values(state)
        for name, change in update.items():
            try:
                values[name] = self.fields[name].reducer(values.get(name), change)
            except (TypeError, ValueError) as exc:
                raise StateValidationError(
                    f"{self.name}.{name}: reducer {self.fields[name].reducer.name} rejected "
                    f"the update: {exc}"
                ) from exc
        if previous is None:
            return self.validate(values)
        return self.validate_extending(values, previous)[0]

    # --- loading stored data ------------------------------------------------------------------

    def load(self, data: JSONState, *, stored_name: str, stored_version: int) -> S:
        """A state from stored JSON data, migrated from ``stored_version`` if older.

        Raises:
            StateMigrationError: another schema's data, a version newer than this code, a
                missing migration, or data whose fields do not match the schema (a field added
                without a migration is never filled with its default).
            StateValidationError: the migrated data fails validation.
        """
        return self.validate(
            self.migrate(data, stored_name=stored_name, stored_version=stored_version)
        )

    def migrate(self, data: JSONState, *, stored_name: str, stored_version: int) -> JSONState:
        """Stored JSON data brought to the current schema version, field set checked."""
        if stored_name != self.name:
            raise StateMigrationError(
                f"stored state belongs to schema {stored_name!r}, not {self.name!r}"
            )
        if stored_version > self.version:
            raise StateMigrationError(
                f"stored {self.name} state has schema version {stored_version}, newer than "
                f"this code's version {self.version}; upgrade the code"
            )
        current = dict(data)
        for source in range(stored_version, self.version):
            step = self._migrations.get(source)
            if step is None:
                raise StateMigrationError(
                    f"stored {self.name} state is schema version {source} and no migration "
                    f"to version {source + 1} is registered"
                )
            try:
                current = dict(step(dict(current)))
            except Exception as exc:
                raise StateMigrationError(
                    f"migration of {self.name} from version {source} to {source + 1} failed: "
                    f"{type(exc).__name__}: {exc}"
                ) from exc
        self._check_fields(current, stored_version)
        return current

    def _check_fields(self, data: JSONState, stored_version: int) -> None:
        missing = sorted(
            name
            for name, field in self.fields.items()
            if name not in data and (self.is_model or field.required)
        )
        extra = sorted(set(data) - set(self.fields))
        if missing or extra:
            parts = []
            if missing:
                parts.append(f"lacks field(s) {', '.join(missing)}")
            if extra:
                parts.append(f"has unknown field(s) {', '.join(extra)}")
            raise StateMigrationError(
                f"stored {self.name} state (written as schema version {stored_version}) "
                f"{' and '.join(parts)} for schema version {self.version}; bump the version "
                "and register a migration instead of loading defaults silently"
            )

    def __repr__(self) -> str:
        return f"StateSchema({self.name!r}, version={self.version})"


def _extensible_lists(model: type[BaseModel]) -> frozenset[str]:
    """The list fields of ``model`` whose new items may be validated alone (``validate_extending``).

    A field qualifies when nothing of the model but the list's own item validation looks at it:
    the field is a plain list (no length bound, no validator of its own), the model's only model
    validators are ``AgentState``'s (which reads ``step`` and ``max_steps``), it has no
    ``__init__`` or ``model_post_init`` of its own, and no validator or default factory anywhere
    in its schema is handed the other fields' values. Any other model is validated whole.
    """
    allowed = {d.func for d in AgentState.__pydantic_decorators__.model_validators.values()}
    decorators = model.__pydantic_decorators__
    if any(d.func not in allowed for d in decorators.model_validators.values()) or (
        decorators.root_validators
        or decorators.validators
        or model.__pydantic_post_init__ is not None
    ):
        return frozenset()
    root: dict[str, Any] | None = None
    pending: list[Any] = [model.__pydantic_core_schema__]
    while pending:
        node = pending.pop()
        if isinstance(node, list | tuple):
            pending.extend(node)
            continue
        if not isinstance(node, dict):
            continue
        if node.get("type") == "model" and node.get("cls") is model:
            root = node
        function = node.get("function")
        if isinstance(function, dict) and function.get("type") == "with-info":
            return frozenset()
        if node.get("default_factory_takes_data"):
            return frozenset()
        pending.extend(node.values())
    if root is None or root.get("custom_init"):
        return frozenset()
    extensible: set[str] = set()
    for name, field in root["schema"]["fields"].items():
        schema = field["schema"]
        if schema["type"] == "default":
            schema = schema["schema"]
        if schema["type"] == "list" and "min_length" not in schema and "max_length" not in schema:
            extensible.add(name)
    return frozenset(extensible)


_ADAPTERS: dict[tuple[int, str], TypeAdapter[Any]] = {}


def _field_adapter(model: type[BaseModel], field: str) -> TypeAdapter[Any]:
    key = (id(model), field)
    adapter = _ADAPTERS.get(key)
    if adapter is None:
        info = model.model_fields[field]
        annotation: Any = info.annotation
        adapter = TypeAdapter(annotation)
        _ADAPTERS[key] = adapter
    return adapter


def _typed_dict_field_adapter(state_type: Any, field: str) -> TypeAdapter[Any]:
    key = (id(state_type), field)
    adapter = _ADAPTERS.get(key)
    if adapter is None:
        hint = get_type_hints(state_type, include_extras=True)[field]
        while get_origin(hint) in _WRAPPERS:
            hint = get_args(hint)[0]
        adapter = TypeAdapter(hint)
        _ADAPTERS[key] = adapter
    return adapter
