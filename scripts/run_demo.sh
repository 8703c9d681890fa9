#!/usr/bin/env bash
# One command from a fresh checkout to a verified crash recovery:
#   bash scripts/run_demo.sh [--workdir DIR] [--steps N] [--kill-at K] [--workers W]
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/setup.sh" --demo "$@"
