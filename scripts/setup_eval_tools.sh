#!/usr/bin/env bash
# Install the accuracy tools that talk to the online server (EvalScope, lm-evaluation-harness, and
# the openai client) into a virtualenv of their own, apart from the project's: their dependencies
# (datasets, transformers, pandas pins) are theirs to choose. Idempotent; quiet once done.
#   bash scripts/setup_eval_tools.sh          # prints nothing once installed
#   EVAL_VENV=/somewhere bash scripts/setup_eval_tools.sh
# The venv is $EVAL_VENV if set, else $INFER_RECIPES_HOME/eval-venv (INFER_RECIPES_HOME defaults
# to ~/.cache/infer-recipes). Its commands: $EVAL_VENV/bin/evalscope, $EVAL_VENV/bin/lm_eval.
# Python: $EVAL_PYTHON if set, else python3 (3.10 or newer).
set -euo pipefail

home="${INFER_RECIPES_HOME:-$HOME/.cache/infer-recipes}"
venv="${EVAL_VENV:-$home/eval-venv}"
# The versions ../shared/FACTS.md ("Accuracy tools and load generators, offline") checked offline.
packages=("evalscope==1.14.1" "lm-eval[api]==0.4.13" "openai==3.63.0")
key="${packages[*]}"
marker="$venv/.infer-recipes-eval-tools"

if [[ -f "$marker" && "$(cat "$marker")" == "$key" && -x "$venv/bin/evalscope" && -x "$venv/bin/lm_eval" ]]; then
    exit 0
fi

if [[ ! -x "$venv/bin/python" ]]; then
    echo "[setup-eval] creating $venv" >&2
    mkdir -p "$(dirname "$venv")"
    "${EVAL_PYTHON:-python3}" -m venv "$venv"
fi
# One install at a time: a second caller (two test sessions) waits, then finds the marker.
exec 9>"$venv/.install.lock"
flock 9
if [[ -f "$marker" && "$(cat "$marker")" == "$key" && -x "$venv/bin/evalscope" && -x "$venv/bin/lm_eval" ]]; then
    exit 0
fi
echo "[setup-eval] installing ${key} into $venv (about 1.4 GB, a few minutes)" >&2
"$venv/bin/python" -m pip install -q --disable-pip-version-check "${packages[@]}"
echo "$key" >"$marker"
