#!/usr/bin/env bash
# The test command of the README: set up .venv with the test extras, then run the CPU test suite.
# pytest's exit code 5 (no tests collected) is a failure here, not a pass.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test || exit 1
# The suite runs in one worker per core (at most 4; HYLO_TEST_WORKERS=0: one process), each with one torch thread:
# its models are tiny, so a step is host-bound and two workers on two cores take about 0.6x one process's time.
cores=$(getconf _NPROCESSORS_ONLN 2>/dev/null || echo 1)
workers=${HYLO_TEST_WORKERS:-$(( cores < 4 ? cores : 4 ))}
par=()
if [ "$workers" -gt 1 ]; then
    par=(-n "$workers" --dist load)
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
fi
.venv/bin/python -m pytest -q ${par[@]+"${par[@]}"} "$@"
rc=$?
if [ "$rc" -eq 5 ]; then
    echo "error: pytest collected no tests" >&2
    exit 1
fi
exit "$rc"
