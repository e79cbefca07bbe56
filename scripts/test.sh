#!/usr/bin/env bash
# The test command of the README: set up .venv with the test extras, then run the CPU test suite.
# pytest's exit code 5 (no tests collected) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test || exit 1
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
