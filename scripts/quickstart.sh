#!/usr/bin/env bash
# Set up, materialise the SmolLM2 testbed, and run the default pipeline on it (about 2 hours on 2 CPU cores):
# one self-distilled data set → proxy head (recipes/proxy_head.py) → draft (recipes/drafter.py, same data) →
# Spec-Bench on a small subset with every method, the report with its charts.
# Each stage resumes or is skipped when re-run; set MIRROR_QUICKSTART_QUESTIONS (questions per Spec-Bench task).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mirror-train fetch-testbed
# the flags only answer accelerate's questions; each recipe's precision is its config's train.mixed_precision
launch() { accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no "$@"; }
[ -f outputs/proxy_head_smollm2/export/mirror_config.json ] || \
    launch recipes/proxy_head.py --config recipes/configs/proxy_head_smollm2.yaml
[ -f outputs/drafter_smollm2/export/mirror_config.json ] || \
    launch recipes/drafter.py --config recipes/configs/drafter_smollm2.yaml
mirror-eval specbench --out outputs/specbench_quickstart \
    --proxy-head outputs/proxy_head_smollm2/export --draft outputs/drafter_smollm2/export \
    --limit-per-category "${MIRROR_QUICKSTART_QUESTIONS:-1}" --max-new-tokens 64
echo "report: outputs/specbench_quickstart/report.md (charts beside it); artifacts: outputs/*/export"
