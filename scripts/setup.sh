#!/usr/bin/env bash
# Creates .venv (if missing) and installs hylo into it with the extras given as arguments (e.g. "test").
# torch is installed first, pinned to a CPU build where one is on disk: a plain `torch` requirement may otherwise
# pull a multi-GB CUDA build. TORCH_INDEX_URL (e.g. https://download.pytorch.org/whl/cpu) is the index torch comes
# from, where the default index would give a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-}"
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/python -m pip install -q "torch==2.13.0" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi
if [ -n "$extras" ]; then
    .venv/bin/python -m pip install -q -e ".[${extras}]"
else
    .venv/bin/python -m pip install -q -e .
fi
