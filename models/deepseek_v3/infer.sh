#!/usr/bin/env bash
# Run a DeepSeek-V3-style model: bash models/deepseek_v3/infer.sh [config.yaml] [--set section.key=value ...]
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
root=$(cd "$here/../.." && pwd)
source "$root/scripts/setup.sh"
yaml="$here/config/tiny_random.yaml"
if [[ $# -gt 0 && $1 != --* ]]; then yaml=$1; shift; fi
cd "$root"
exec "$PYTHON" -m executor.offline.launch --yaml "$yaml" "$@"
