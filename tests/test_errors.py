from __future__ import annotations

import inspect

from keel import errors


def _exception_classes() -> list[type[BaseException]]:
    return [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]


def test_every_error_descends_from_the_single_root() -> None:
    for cls in _exception_classes():
        assert issubclass(cls, errors.KeelError), cls


def test_usage_and_runtime_errors_are_disjoint() -> None:
    for cls in _exception_classes():
        if cls in (errors.KeelError,):
            continue
        is_usage = issubclass(cls, errors.UsageError)
        is_runtime = issubclass(cls, errors.KeelRuntimeError)
        assert is_usage != is_runtime, cls


def test_docstring_tree_names_every_class_and_all_is_complete() -> None:
    doc = errors.__doc__ or ""
    names = {cls.__name__ for cls in _exception_classes()}
    for name in names:
        assert name in doc, f"{name} missing from the hierarchy drawing"
        assert (getattr(errors, name).__doc__ or "").strip(), f"{name} has no docstring"
    assert set(errors.__all__) == names
    assert errors.__all__ == sorted(errors.__all__)


def test_structured_errors_carry_their_facts() -> None:
    conflict = errors.ConflictError("session:1", expected=3, actual=4)
    assert (conflict.expected, conflict.actual) == (3, 4)
    assert isinstance(conflict, errors.StoreError)
    overflow = errors.ContextOverflowError(
        "system prompt and rules do not fit", sections={"system": 900, "rules": 300}, limit=1000
    )
    assert "system=900" in str(overflow) and overflow.limit == 1000
    assert issubclass(errors.ContextLengthExceededError, errors.BadRequestError)
    assert issubclass(errors.TruncatedResponseError, errors.MalformedResponseError)
