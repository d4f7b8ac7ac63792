#!/usr/bin/env bash
# Set up the environment (scripts/setup.sh), then run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
