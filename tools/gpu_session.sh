#!/usr/bin/env bash
# The GPU measurements of a working session, in two calls that each fit the device tool's 600 s limit.
#   bash tools/gpu_session.sh tests OUT   # pytest tests/gpu (about 240 s), the prefill profile, a step's launches
#   bash tools/gpu_session.sh bench OUT   # kernel sweeps whose winners the bench then uses, the bench, profiles
# Everything is written under OUT (the device tool's $OUT); the summary lines go to stdout.
set -u
phase=${1:?tests or bench}
out=${2:?output folder}
mkdir -p "$out"
case "$phase" in
  tests)
    timeout 330 python3 -m pytest -q -p no:cacheprovider tests/gpu > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -15
    timeout 150 python3 tools/profile_step.py --prefill 8192 --out "$out" > "$out/prof_prefill.txt" 2>&1
    head -16 "$out/prof_prefill.txt" | tail -14; grep -A4 "synchronising" "$out/prof_prefill.txt"
    # every launch of one graph-replayed step, in order (which neighbours to fuse, where the idle gaps are)
    timeout 110 python3 tools/profile_step.py --graphs --launches --bs 1 64 --out "$out" > "$out/prof_step.txt" 2>&1
    grep -E "^==|launches," "$out/prof_step.txt"
    ;;
  bench)
    timeout 170 python3 tools/tune_kernels.py --only grouped conv --out "$out" --env "$out/tuned.env" \
      > "$out/tune.txt" 2>&1
    grep -v "^    " "$out/tune.txt"; cat "$out/tuned.env" 2>/dev/null
    [ -f "$out/tuned.env" ] && . "$out/tuned.env"
    timeout 380 python3 -m hylo bench --vs-hf --pdl --out "$out" > "$out/bench.txt" 2>&1
    echo "bench rc=$?"; grep "^\[bench\]" "$out/bench.txt"
    ;;
  bench-first)  # when little device time is left: the bench with the committed defaults, then the sweeps
    timeout 380 python3 -m hylo bench --vs-hf --pdl --out "$out" > "$out/bench.txt" 2>&1
    echo "bench rc=$?"; grep "^\[bench\]" "$out/bench.txt"
    timeout 170 python3 tools/tune_kernels.py --only grouped conv --out "$out" --env "$out/tuned.env" \
      > "$out/tune.txt" 2>&1
    grep -v "^    " "$out/tune.txt"; cat "$out/tuned.env" 2>/dev/null
    ;;
  bench-short)  # the least device time: hylo's own rows only (no HF, no sweeps), as far as the limit lets it go
    python3 -m hylo bench --pdl --out "$out" > "$out/bench.txt" 2>&1
    echo "bench rc=$?"; grep "^\[bench\]" "$out/bench.txt"
    ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
