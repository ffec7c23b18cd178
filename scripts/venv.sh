#!/usr/bin/env bash
# Creates (or reuses) .venv in the checkout and installs stratagem into it.
#   scripts/venv.sh train   what the main job needs (`stratagem train`: torch, grpcio, rich, scikit-learn)
#   scripts/venv.sh dev     everything the tests need (the default): the train set plus transformers,
#                           tensorboard, hypothesis, ruff, mypy, ...
# torch is pinned for development so pip never pulls a multi-GB CUDA build by accident;
# the library itself accepts torch>=2.3.
set -euo pipefail
profile="${1:-dev}"
case "$profile" in
    train | dev) ;;
    *)
        echo "scripts/venv.sh: unknown set '$profile'. Use 'train' (the main job) or 'dev' (the tests)." >&2
        exit 2
        ;;
esac
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
stamp="$venv/.stratagem-installed"
inputs="$(cat "$root/pyproject.toml" "$root/requirements-dev.txt" | sha256sum | cut -c1-16)"
# The dev set includes the train set, so a venv stamped for dev serves the main job as well.
installed="$(cat "$stamp" 2>/dev/null || true)"
if [ "$installed" = "$inputs dev" ] || [ "$installed" = "$inputs $profile" ]; then
    exit 0
fi
# pip runs quietly (-q) for a minute or more on a first set-up: say what is happening, on stderr (stdout is the job's).
echo "scripts/venv.sh: installing stratagem's '$profile' set into $venv (torch, once: a minute or more)..." >&2
if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip >&2
"$venv/bin/python" -m pip install -q -r "$root/requirements-dev.txt" >&2
"$venv/bin/python" -m pip install -q -e "$root[$profile]" >&2
echo "$inputs $profile" > "$stamp"
echo "scripts/venv.sh: installed; $venv/bin/stratagem is ready." >&2
