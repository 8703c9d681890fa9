#!/usr/bin/env bash
# Idempotent set-up on a fresh machine: torch (only if none is importable), then lowdiff in editable mode with
# its test extras, the remote tier (fsspec, s3fs; moto's S3 server for its tests) and the frameworks its
# integrations support (Lightning, transformers + accelerate), which also installs the `lowdiff-recover` and
# `lowdiff` console scripts.
#
#   bash scripts/setup.sh            # set up
#   bash scripts/setup.sh --demo     # set up, then run examples/demo.py (any further arguments go to it)
#
# PYTHON selects the interpreter (default python3).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"

run_demo=0
if [[ "${1:-}" == "--demo" ]]; then
  run_demo=1
  shift
fi

# Never pull a second torch: an importable one (CPU or CUDA build, any version lowdiff supports) is kept.
if "$PYTHON" -c "import torch" >/dev/null 2>&1; then
  echo "setup: torch $("$PYTHON" -c 'import torch; print(torch.__version__)') already installed"
else
  echo "setup: installing torch==2.13.0"
  "$PYTHON" -m pip install "torch==2.13.0"
fi

torch_before="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
"$PYTHON" -m pip install -e ".[test,integrations,remote]"
# The extras must not replace the torch installed above (a resolver pulling a CUDA build would be gigabytes).
torch_after="$("$PYTHON" -c 'import torch; print(torch.__version__)')"
if [[ "$torch_before" != "$torch_after" ]]; then
  echo "setup: error: installing lowdiff's extras replaced torch $torch_before with $torch_after" >&2
  exit 1
fi

# pip may put console scripts in a directory that is not on PATH (e.g. ~/.local/bin for --user installs).
if ! command -v lowdiff-recover >/dev/null 2>&1; then
  echo "setup: note: lowdiff-recover is not on PATH; it is in $("$PYTHON" -c 'import sysconfig; print(sysconfig.get_path("scripts"))') (examples/demo.py finds it there)"
fi
"$PYTHON" -c "import lowdiff, torch; print(f'setup: lowdiff {lowdiff.__version__} with torch {torch.__version__} ready')"

if [[ "$run_demo" == 1 ]]; then
  exec "$PYTHON" examples/demo.py "$@"
fi
