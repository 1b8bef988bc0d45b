#!/usr/bin/env bash
# Prepare a Python with torch and this package, and the default model; quiet once all is done.
#   source scripts/setup.sh   # as infer.sh and test.sh do: exports PYTHON for the caller
#   bash scripts/setup.sh
# The interpreter is $PYTHON if set, else <repo>/.venv (created with --system-site-packages, so a
# torch already on the machine is reused).

_infer_recipes_setup() {
    local root key prefix marker
    root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd) || return 1
    if [[ -z "${PYTHON:-}" ]]; then
        if [[ ! -x "$root/.venv/bin/python" ]]; then
            echo "[setup] creating $root/.venv" >&2
            python3 -m venv --system-site-packages "$root/.venv" || return 1
        fi
        PYTHON="$root/.venv/bin/python"
    fi
    export PYTHON
    export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"

    # Install only when pyproject.toml or the checkout's location changed since the last time.
    key=$("$PYTHON" -c 'import hashlib, sys; print(hashlib.sha256(open(sys.argv[1], "rb").read()).hexdigest(), sys.argv[2])' \
        "$root/pyproject.toml" "$root") || return 1
    prefix=$("$PYTHON" -c 'import sys; print(sys.prefix)') || return 1
    marker="$prefix/.infer-recipes-installed"
    if [[ ! -f "$marker" || "$(cat "$marker")" != "$key" ]]; then
        # Pinned first: left to the package's "torch>=2.5", pip could pick a newer, larger build.
        if ! "$PYTHON" -c "import torch" 2>/dev/null; then
            echo "[setup] installing torch==2.13.0 into $prefix" >&2
            "$PYTHON" -m pip install -q torch==2.13.0 || return 1
        fi
        echo "[setup] installing infer-recipes (editable, with test extras) into $prefix" >&2
        "$PYTHON" -m pip install -q -e "${root}[test]" || return 1
        echo "$key" >"$marker" 2>/dev/null || true
    fi

    (cd "$root" && "$PYTHON" -m executor.model_loader.default_model >/dev/null) || return 1
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    set -euo pipefail
    _infer_recipes_setup
else
    _infer_recipes_setup || { unset -f _infer_recipes_setup; return 1; }
fi
unset -f _infer_recipes_setup
