#!/usr/bin/env bash
# Set up, materialise the SmolLM2 testbed, and run the main job on it: the early-exit sweep (a minute or two), then
# the default proxy-head distillation (about 40 minutes on 2 CPU cores, data generation included).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mirror-train fetch-testbed
mirror-train sweep-exit --num-prompts 16 --out outputs/sweep_exit.json
accelerate launch --num_processes 1 --num_machines 1 --mixed_precision no --dynamo_backend no \
    recipes/proxy_head.py --config recipes/configs/proxy_head_smollm2.yaml
echo "proxy head exported to outputs/proxy_head_smollm2/export (model card: outputs/proxy_head_smollm2/export/README.md)"
