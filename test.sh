#!/usr/bin/env bash
# Run the tests: bash test.sh [pytest args]. Without args, tests marked slow are skipped unless
# RUN_SLOW=1; CI (.ci/run) runs -m "not long": the slow tests too, but those marked long (past its budget).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$root/scripts/setup.sh"
cd "$root"
if [[ $# -eq 0 && "${RUN_SLOW:-0}" != 1 ]]; then
    set -- -m "not slow"
fi
exec "$PYTHON" -m pytest -q "$@"  # no paths given: pyproject's testpaths, i.e. tests/
