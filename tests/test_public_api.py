from __future__ import annotations

import keel


def test_all_is_sorted_and_importable() -> None:
    assert keel.__all__ == sorted(keel.__all__)
    for name in keel.__all__:
        assert hasattr(keel, name), name


def test_version_is_a_string() -> None:
    assert isinstance(keel.__version__, str) and keel.__version__.count(".") == 2
