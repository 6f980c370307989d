#!/usr/bin/env bash
# Run a job from the Procfile under honcho, one process per role, in a fresh run dir.
#   scripts/honcho_run.sh [JOB] [TRAINERS]      e.g. scripts/honcho_run.sh lm 2
# The scheduler exits when the run is done; honcho then stops the other roles
# (each exits cleanly on SIGTERM). Watch it with: fucina monitor --run-dir $RUN_DIR
set -euo pipefail
cd "$(dirname "$0")/.."
export JOB="${1:-lm}" TRAINERS="${2:-2}"
export RUN_DIR="${RUN_DIR:-runs/honcho-$JOB-$(date +%Y%m%d-%H%M%S)}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
HONCHO="$(command -v honcho || echo .venv/bin/honcho)"
PATH="$PWD/.venv/bin:$PATH" exec "$HONCHO" start -c "trainer=$TRAINERS"
