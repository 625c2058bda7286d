#!/usr/bin/env bash
# Install mirror-train and its dependencies into the current Python (use a venv if you prefer).
# torch comes first and pinned: a bare `torch` requirement can pull a multi-GB CUDA build on a CPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m pip install --quiet --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}"
"$PY" -m pip install --quiet --disable-pip-version-check -e ".[dev,deepspeed]"
