from __future__ import annotations

import keel.models
import keel.testing


def test_models_and_testing_export_sorted_importable_names() -> None:
    for module in (keel.models, keel.testing):
        assert module.__all__ == sorted(module.__all__)
        for name in module.__all__:
            assert hasattr(module, name), (module.__name__, name)
    assert {"resolve_model", "parse_tool_calls", "RetryPolicy", "LocalModel"} <= set(
        keel.models.__all__
    )
    assert "FaultServer" in keel.testing.__all__


def test_importing_models_does_not_load_provider_sdks_or_weights() -> None:
    import subprocess
    import sys

    code = (
        "import sys, keel.models, keel.testing; "
        "print(' '.join(m for m in ('openai', 'llama_cpp') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == ""
