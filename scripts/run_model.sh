#!/usr/bin/env bash
# What every models/<m>/infer.sh runs:
#   bash scripts/run_model.sh <default yaml> [config.yaml] [--mode offline|online] [--port N] [--set section.key=value ...]
# The first argument after the default, unless it is an option, replaces the default config.
# --mode online starts the OpenAI-compatible server (executor/online) instead of the offline run;
# the server's own options (--port, --host, --served-model-name, --pd-role prefill|decode, ...) pass
# through; --pd-role makes it one half of a prefill-decode disaggregated pair (docs/online.md).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
yaml=${1:?usage: run_model.sh <default yaml> [config.yaml] [--mode offline|online] [--set section.key=value ...]}
shift
if [[ $# -gt 0 && $1 != --* ]]; then yaml=$1; shift; fi
mode=offline args=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --mode)
            mode=${2:?--mode needs offline or online}
            [[ $mode == offline || $mode == online ]] || { echo "error: --mode $mode: offline or online" >&2; exit 2; }
            shift 2 ;;
        --pd-role) pd_role=${2:?--pd-role needs prefill or decode}; args+=("$1" "$2"); shift 2 ;;
        *) args+=("$1"); shift ;;
    esac
done
if [[ -n ${pd_role:-} && $mode != online ]]; then
    echo "error: --pd-role $pd_role runs with --mode online (prefill-decode disaggregation is an online mode)" >&2
    exit 2
fi
source "$root/scripts/setup.sh"
cd "$root"
exec "$PYTHON" -m "executor.$mode.launch" --yaml "$yaml" ${args[@]+"${args[@]}"}
