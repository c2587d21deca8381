#!/usr/bin/env bash
# Run uv, bootstrapping it from PyPI into .tools/ when it is not on PATH, and pointing it at a Python 3.12
# (megatron-bridge 0.6.2 / megatron-core 0.19.2 need 3.12; uv cannot download one here: only PyPI is reachable).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
uv_bin="$(command -v uv || true)"
if [ -z "$uv_bin" ]; then
  uv_bin="$root/.tools/uv/bin/uv"
  if [ ! -x "$uv_bin" ]; then
    echo "uv not found: installing it from PyPI into .tools/uv" >&2
    python3 -m pip install --quiet --disable-pip-version-check --target "$root/.tools/uv" uv >&2
  fi
fi
if [ -z "${UV_PYTHON:-}" ]; then
  # pyenv's own answer for where its versions live ($PYENV_ROOT, else `pyenv root`), never one machine's home.
  pyenv_root="${PYENV_ROOT:-$(pyenv root 2>/dev/null || true)}"
  for cand in "$(command -v python3.12 || true)" ${pyenv_root:+"$pyenv_root"/versions/3.12*/bin/python3.12} \
      /usr/bin/python3.12; do
    if [ -n "$cand" ] && [ -x "$cand" ] && "$cand" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      export UV_PYTHON="$cand"; break
    fi
  done
fi
[ -n "${UV_PYTHON:-}" ] || { echo "error: no Python 3.12 found; install one or set UV_PYTHON=/path/to/python3.12" >&2; exit 2; }
# The first command in a checkout installs the pinned stack (uv.lock) into .venv: say what and how big before the
# minutes it takes, and let uv show its progress (the Makefile's `uv run --quiet` would hide it).
venv="${UV_PROJECT_ENVIRONMENT:-$root/.venv}"
if [ ! -x "$venv/bin/python" ] && { [ "${1:-}" = run ] || [ "${1:-}" = sync ]; }; then
  echo "first run: installing the pinned stack from uv.lock into $venv: torch with its CUDA libraries, Megatron" \
    "Bridge and Core, nemo_run (about 8.3 GB on disk, measured 2026-12-03; a few minutes with a cold uv cache)" >&2
  if [ "$1" = run ]; then
    (cd "$root" && "$uv_bin" sync --frozen) >&2
  fi
fi
exec "$uv_bin" "$@"
