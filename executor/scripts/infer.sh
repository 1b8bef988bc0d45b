#!/usr/bin/env bash
# cann-recipes' entry: bash executor/scripts/infer.sh --model <dir> --yaml <file> [--mode offline|online] [--pd-role prefill|decode] [--port N] [--set section.key=value ...]
# runs models/<dir>/config/<file> (a path to an existing file also works for --yaml), offline or as
# the online server, as `bash models/<dir>/infer.sh <yaml> --mode ...` does. Sets itself up on first
# run (scripts/setup.sh).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
usage="usage: bash executor/scripts/infer.sh --model <folder under models/> --yaml <file under models/<folder>/config/> [--mode offline|online] [--pd-role prefill|decode] [--port N] [--host H] [--served-model-name NAME] [--set section.key=value ...]"
model="" yaml="" mode=offline overrides=()
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) model=${2:?--model needs a value}; shift 2 ;;
        --yaml) yaml=${2:?--yaml needs a value}; shift 2 ;;
        --mode)
            mode=${2:-}
            if [[ $mode != offline && $mode != online ]]; then
                echo "error: --mode ${2:-}: offline or online" >&2
                exit 2
            fi
            shift 2 ;;
        --port|--host|--served-model-name|--max-waiting-requests|--graceful-timeout-s|--pd-role)
            overrides+=("$1" "${2:?$1 needs a value}"); shift 2 ;;
        --set) overrides+=(--set "${2:?--set needs section.key=value}"); shift 2 ;;
        -h|--help) echo "$usage"; exit 0 ;;
        *) echo "error: unknown option $1; $usage" >&2; exit 2 ;;
    esac
done
if [[ -z $model || -z $yaml ]]; then
    echo "error: --model and --yaml are both needed; $usage" >&2
    exit 2
fi
if [[ ! -d $root/models/$model ]]; then
    echo "error: no folder models/$model; folders: $(cd "$root/models" && for d in */__init__.py; do printf "%s " "${d%/__init__.py}"; done)" >&2
    exit 2
fi
config="$root/models/$model/config/$yaml"
if [[ ! -f $config && -f $yaml ]]; then config=$(cd "$(dirname "$yaml")" && pwd)/$(basename "$yaml"); fi
if [[ ! -f $config ]]; then
    echo "error: no $yaml in models/$model/config/; there: $(cd "$root/models/$model/config" && ls | xargs)" >&2
    exit 2
fi
echo "====================> launch $mode inference (model=$model, yaml=$yaml)"
exec bash "$root/scripts/run_model.sh" "$config" --mode "$mode" ${overrides[@]+"${overrides[@]}"}
