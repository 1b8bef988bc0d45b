#!/usr/bin/env bash
# Run a Step-3.7-Flash model: bash models/step3p7_flash/infer.sh [config.yaml] [--set section.key=value ...]
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/../../scripts/run_model.sh" "$here/config/tiny_random.yaml" "$@"
