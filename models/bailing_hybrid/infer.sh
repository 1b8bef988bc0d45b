#!/usr/bin/env bash
# Run a Ling 3 (Bailing hybrid) model: bash models/bailing_hybrid/infer.sh [config.yaml] [--set section.key=value ...]
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
exec bash "$here/../../scripts/run_model.sh" "$here/config/tiny_random.yaml" "$@"
