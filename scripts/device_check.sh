#!/usr/bin/env bash
# Run every paged-attention device check in one call (fits a 10-minute device call: the script budgets itself
# to ~7 minutes and is killed at 9.5). JSON goes to $OUT/device_check_results.json if $OUT is set, else to
# ./device_check_results.json. Extra arguments are passed through (e.g. --smoke on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
out_dir="${OUT:-.}"
exec timeout 570 python scripts/device_check.py --out "${out_dir}/device_check_results.json" "$@"
