#!/usr/bin/env bash
# Creates (or reuses) .venv in the checkout and installs stratagem with its dev extras.
# torch is pinned for development so pip never pulls a multi-GB CUDA build by accident;
# the library itself accepts torch>=2.3.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.stratagem-installed"
want="$(cat "$root/pyproject.toml" "$root/requirements-dev.txt" | sha256sum | cut -c1-16)"
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -r "$root/requirements-dev.txt" >&2
    "$venv/bin/python" -m pip install -q -e "$root[dev]" >&2
    echo "$want" > "$stamp"
fi
