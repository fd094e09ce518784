#!/usr/bin/env bash
# Creates .venv with a Python >= 3.12 found on this machine (PATH first, then pyenv's versions) and
# installs moejax with its dev extras. Re-running is cheap: it reinstalls only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."

is_ok() { "$1" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; }

find_python() {
  local c
  for c in "${PYTHON:-}" python3.13 python3.12 python3 python; do
    [ -n "$c" ] && command -v "$c" >/dev/null 2>&1 && is_ok "$(command -v "$c")" && { command -v "$c"; return; }
  done
  local roots=()
  command -v pyenv >/dev/null 2>&1 && roots+=("$(pyenv root)")
  roots+=("${PYENV_ROOT:-$HOME/.pyenv}" /root/.pyenv /usr/local/pyenv /opt/pyenv)
  for r in "${roots[@]}"; do
    for c in $(ls -d "$r"/versions/3.*/bin/python3 2>/dev/null | sort -V -r); do
      is_ok "$c" && { echo "$c"; return; }
    done
  done
  return 1
}

if [ ! -x .venv/bin/python ] || ! is_ok .venv/bin/python; then
  py=$(find_python) || { echo "setup: no Python >= 3.12 found (PATH or pyenv); install one or set PYTHON=" >&2; exit 1; }
  echo "setup: creating .venv with $py ($("$py" --version))"
  rm -rf .venv
  "$py" -m venv .venv
fi

stamp=.venv/.moejax-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
