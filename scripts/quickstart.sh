#!/usr/bin/env bash
# Set up, materialise the SmolLM2 testbed, and run the main job on it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
mirror-train fetch-testbed
mirror-train sweep-exit --out outputs/sweep_exit.json
