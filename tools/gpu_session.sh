#!/usr/bin/env bash
# The GPU measurements of a working session, in two calls that each fit the device tool's 600 s limit.
#   bash tools/gpu_session.sh tests OUT   # pytest tests/gpu, the prefill profile, a step's launches
#   bash tools/gpu_session.sh bench OUT   # kernel sweeps whose winners the bench then uses, then the bench
#   (bench-first: the bench, then the sweeps; bench-short: hylo's bench rows alone, for a short device budget;
#    changed: the GPU tests selected by HYLO_TESTS_K, the bench and the prefill profile;
#    tests-host: the GPU tests, then the host profile of overlapped decode at batch 1, 64 and 256 and a step's
#    launches, in place of the prefill profile; tests-bench: the GPU tests, bench-short, then a step's launches)
# The GPU suite alone took 350-480 s on a fresh machine in one process (Triton compiles every kernel first; 77 s
# once compiled): the phases that add profiles to it may reach the device's 600 s limit; what they wrote under OUT
# still comes back.
# Everything is written under OUT (the device tool's $OUT); the summary lines go to stdout.
# On the device machine (no registry there): carry fla-core 0.6.0 and einops as wheels in .whl (the device tool's
# README says how to download them), then start the command with
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site --find-links .whl fla-core einops outlines-core \
#     llguidance
#   export PYTHONPATH=/tmp/site:$PWD
# (.whl holds outlines-core for several Pythons: pip picks the one that fits)
# ($PWD too: the tools run as scripts import hylo from the checkout).
set -u
phase=${1:?tests, tests-host, tests-bench, check, tune-bench, bench, bench-first, bench-short, fma, changed, model, prefix, mamba2, structured, s25, s26, s27-nemotron, s27-fp8, s28, s28b, s28c, s29, s29-80b, s29-tiles, s29-final, s30, s32 or s20}
out=${2:?output folder}
mkdir -p "$out"
# The GPU tests run in parallel workers where pytest-xdist is installed (the device image has it), so that a fresh
# machine's Triton compiles run side by side (since session 20; the saving is not yet measured).
# HYLO_TEST_WORKERS=0 runs them in one process.
par=""
if [ "${HYLO_TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then
  par="-n ${HYLO_TEST_WORKERS:-8} --dist load"
fi

sweeps() {  # the kernel sweeps whose winners a bench right after uses (tuned.env)
  timeout 170 python3 tools/tune_kernels.py --only grouped conv --out "$out" --env "$out/tuned.env" \
    > "$out/tune.txt" 2>&1
  grep -v "^    " "$out/tune.txt"; cat "$out/tuned.env" 2>/dev/null
}

bench() {  # bench TIMEOUT [bench options]: hylo bench --pdl (TIMEOUT 0: no limit of its own)
  local limit=$1; shift
  timeout "$limit" python3 -m hylo bench --pdl "$@" --out "$out" > "$out/bench.txt" 2>&1
  echo "bench rc=$?"; grep "^\[bench\]" "$out/bench.txt"
}

gputests() {
  timeout 450 python3 -m pytest -q -p no:cacheprovider $par --durations=12 tests/gpu > "$out/gputests.txt" 2>&1
  echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -15
  grep -A13 "slowest" "$out/gputests.txt" | cut -c1-110  # where the suite's time goes
}

launches() {  # every launch of one graph-replayed step, in order (which neighbours to fuse, where the idle gaps are)
  timeout 110 python3 tools/profile_step.py --graphs --launches --bs 1 64 --out "$out" > "$out/prof_step.txt" 2>&1
  grep -E "^==|launches," "$out/prof_step.txt"
}

case "$phase" in
  tests)
    gputests
    timeout 150 python3 tools/profile_step.py --prefill 8192 --out "$out" > "$out/prof_prefill.txt" 2>&1
    head -16 "$out/prof_prefill.txt" | tail -14; grep -A4 "synchronising" "$out/prof_prefill.txt"
    grep -A1 "layer timeline" "$out/prof_prefill.txt"
    launches
    ;;
  tests-host)
    gputests
    timeout 150 python3 tools/profile_step.py --host --bs 1 64 256 --out "$out" > "$out/prof_host.txt" 2>&1
    grep -E "^==|tottime|^ +[0-9]" "$out/prof_host.txt" | head -60
    timeout 120 python3 tools/profile_step.py --prefill 8192 --out "$out" > "$out/prof_prefill.txt" 2>&1
    grep -E "^==|prefill|tottime|^ +[0-9]+ +[0-9.]+ +[0-9.]+ +[0-9.]" "$out/prof_prefill.txt" | head -40
    ;;
  bench) sweeps; [ -f "$out/tuned.env" ] && . "$out/tuned.env"; bench 380 --vs-hf ;;
  bench-first) bench 380 --vs-hf; sweeps ;;  # little device time left: the committed defaults first
  bench-short) bench 0 ;;
  fma)  # the one-row CUDA-core GEMV's and the Triton pair-row gather's sweeps, then the decode step with the
        # one-row GEMV (the default) against the tensor-core one (same call)
    timeout 170 python3 tools/tune_kernels.py --only fma gather --out "$out" > "$out/tune.txt" 2>&1
    grep -v "^    " "$out/tune.txt"
    timeout 300 python3 tools/ab_decode.py --variant tc:HYLO_GEMV_FMA=0 --variant fma: --rounds 2 --bs 1 8 \
      --out "$out" 2>&1 | tail -8
    ;;
  check) gputests; bench 0 ;;  # the least device time that both checks a tree and measures it
  tests-bench) gputests; bench 0; launches ;;  # a new tree's first call: is it right, how fast, which launches
  tune-bench)  # the step and conv sweeps, the bench with their winners, the prefill profile (where the GPU waits)
    timeout 150 python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k "prefill" > "$out/gputests.txt" 2>&1
    echo "pytest (prefill kernels) rc=$?"; tail -3 "$out/gputests.txt"
    timeout 280 python3 tools/tune_kernels.py --only conv steps sampling --out "$out" --env "$out/tuned.env" > "$out/tune.txt" 2>&1
    grep -v "^    " "$out/tune.txt" | tail -40; cat "$out/tuned.env" 2>/dev/null
    [ -f "$out/tuned.env" ] && . "$out/tuned.env"
    bench 150
    timeout 100 python3 tools/profile_step.py --prefill 8192 --out "$out" > "$out/prof_prefill.txt" 2>&1
    grep -E "^==|idle|gap|prefill 8192" "$out/prof_prefill.txt" | head -24; grep -A1 "layer timeline" "$out/prof_prefill.txt"
    ;;  # the least device time: hylo's own rows only, as far as the device limit lets it go
  changed)  # a tree whose last check passed: the GPU tests of what changed since (-k), the bench, the prefill profile
    timeout 240 python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k "${HYLO_TESTS_K:?HYLO_TESTS_K}" \
      > "$out/gputests.txt" 2>&1
    echo "pytest -k \"$HYLO_TESTS_K\" rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -15
    bench 200
    timeout 120 python3 tools/profile_step.py --prefill 8192 --out "$out" > "$out/prof_prefill.txt" 2>&1
    head -16 "$out/prof_prefill.txt" | tail -14; grep -A1 "layer timeline" "$out/prof_prefill.txt"
    ;;
  s20)  # session 20's removal of the slower alternatives: the GPU tests of the kernels and paths it touched,
         # then hylo's bench rows (no HF: they are unchanged by it) as far as the call's limit lets them go
    timeout 300 python3 -m pytest -q -p no:cacheprovider $par tests/gpu/test_kernels_linear.py \
      tests/gpu/test_kernels_route.py tests/gpu/test_kernels_moe_norm.py tests/gpu/test_engine_gpu.py \
      > "$out/tests20.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/tests20.txt" | tail -12
    bench 0
    ;;
  model)  # bash tools/gpu_session.sh model OUT NAME: the GPU tests selected by HYLO_TESTS_K (if set), then a model
          # shape's core bench records (hylo bench --model-name NAME --short)
    if [ -n "${HYLO_TESTS_K:-}" ]; then
      timeout 240 python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k "$HYLO_TESTS_K" > "$out/gputests.txt" 2>&1
      echo "pytest -k \"$HYLO_TESTS_K\" rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -15
    fi
    bench 0 --model-name "${3:?benchmark model name}" --short
    ;;
  prefix)  # the prefix-cache GPU tests (hits on the fast path, the batched extend attention), then the replay bench
          # (each mode warmed up first; 32 x 5 took 167 s cold with the cache on in session 23, 16 x 4 about 70 s)
    timeout 200 python3 -m pytest -q -p no:cacheprovider $par tests/gpu/test_engine_gpu.py tests/gpu/test_kernels_attention.py \
      -k "prefix or extend" > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -15
    timeout 300 python3 -m hylo bench --prefix-replay --model-name "${3:-bench-6b}" --conversations 16 --turns 4 \
      --out "$out" > "$out/prefix.txt" 2>&1
    echo "prefix bench rc=$?"; grep "^\[bench\]" "$out/prefix.txt"; tail -5 "$out/prefix.txt"
    ;;
  mamba2)  # the Mamba2 kernels and the three Mamba2 families' fast path on the GPU, then nemotron-h-8b's core records
    timeout 240 python3 -m pytest -q -p no:cacheprovider $par tests/gpu/test_kernels_mamba2.py \
      tests/gpu/test_kernels_gdn_conv.py tests/gpu/test_engine_shapes.py -k "mamba2 or conv or nemotron or granite or falcon" \
      > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -15
    bench 0 --model-name nemotron-h-8b --short
    ;;
  structured)  # the GPU tests selected by HYLO_TESTS_K (if set), then constrained decoding's cost (bench --structured)
    if [ -n "${HYLO_TESTS_K:-}" ]; then
      timeout 280 python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k "$HYLO_TESTS_K" > "$out/gputests.txt" 2>&1
      echo "pytest -k \"$HYLO_TESTS_K\" rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -15
    fi
    timeout 280 python3 -m hylo bench --structured --model-name "${3:-bench-6b}" --out "$out" > "$out/structured.txt" 2>&1
    echo "structured bench rc=$?"; grep "^\[bench\]" "$out/structured.txt"; tail -3 "$out/structured.txt"
    ;;
  s25)  # session 25 in one call: the GPU tests of its kernels and paths, the structured bench, Nemotron 3's records
    timeout 200 python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k "non_gated or grouped_sigmoid or nemotron-3 \
      or constrained or fused_moe_matches or prefill_sized" > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -12
    timeout 130 python3 -m hylo bench --structured --out "$out" > "$out/structured.txt" 2>&1
    echo "structured bench rc=$?"; grep "^\[bench\]" "$out/structured.txt"; tail -2 "$out/structured.txt"
    bench 0 --model-name nemotron-3-nano-30b-a3b --short
    ;;
  s26)  # session 26: FP8 one-row tiles over several blocks, Nemotron 3's folded shared expert and MTP, the 80B FP8
        # shape where the card holds it (an H200), else Qwen3.5-35B's in FP8; the structured bench; a profile
    timeout ${S26_TESTS_S:-150} python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k "fp8 or grouped_sigmoid \
      or non_gated or add_rms_norm or router_logits or nemotron or fused_moe" > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -12
    big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100 * 2 ** 30))")
    if [ "$big" = 1 ]; then fp8=qwen3-next-80b-fp8; else fp8=qwen3.5-35b-a3b-fp8; fi
    bench 110 --model-name nemotron-3-nano-30b-a3b --short; mv "$out/bench.txt" "$out/bench-nemotron.txt"
    bench 160 --model-name $fp8 --short; mv "$out/bench.txt" "$out/bench-fp8.txt"
    timeout 80 python3 tools/profile_step.py --graphs --bs 1 --model-name nemotron-3-nano-30b-a3b --out "$out" \
      > "$out/prof_nemotron.txt" 2>&1
    grep -A14 "^== decode_bs1" "$out/prof_nemotron.txt"
    timeout 60 python3 -m hylo bench --structured --out "$out" > "$out/structured.txt" 2>&1
    echo "structured bench rc=$?"; grep "^\[bench\]" "$out/structured.txt"
    ;;
  s27-nemotron)  # session 26's Nemotron 3 changes checked and A/B'd on the GPU: the folded shared expert (decode and
                 # prefill) and the non-gated pair tile, then the records
    timeout 150 python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k "grouped_sigmoid or non_gated \
      or add_rms_norm or router_logits or nemotron or fused_moe" > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -12
    n3=nemotron-3-nano-30b-a3b
    timeout 150 python3 tools/ab_decode.py --model-name $n3 --bs 1 8 --variant new: \
      --variant apart:HYLO_NEMOTRON_FOLD_SHARED=0 --variant up4:HYLO_PAIR_UP_CFG=4,1024,2,2 --out "$out" 2>&1 | tail -5
    timeout 90 python3 tools/ab_decode.py --model-name $n3 --prefill 8192 --variant new: \
      --variant apart:HYLO_NEMOTRON_FOLD_SHARED=0 --out "$out" 2>&1 | tail -3
    bench 150 --model-name $n3 --short
    timeout 90 python3 tools/profile_step.py --graphs --launches --bs 1 --model-name $n3 --out "$out" \
      > "$out/prof_step.txt" 2>&1  # where batch 1's remaining gap goes (last: the one a full call cuts)
    grep -E "^==|launches," "$out/prof_step.txt"
    ;;
  s27-fp8)  # session 26's FP8 changes checked and A/B'd: one-row tiles over several blocks, the dequantized prefill,
            # and FP8 against bfloat16 at bench-6b's shape (issue 37's batch-1 target); the records of the real sizes
            # follow in their own call: `model OUT qwen3-next-80b-fp8` on an H200, `qwen3.5-35b-a3b-fp8` on an H100
    timeout 120 python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k "fp8" > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -12
    q=qwen3.5-35b-a3b-fp8
    timeout 130 python3 tools/ab_decode.py --model-name $q --bs 1 8 --variant wide: \
      --variant narrow:HYLO_FP8_WIDE_TILES=0 --out "$out" 2>&1 | tail -4
    timeout 100 python3 tools/ab_decode.py --model-name $q --prefill 8192 --variant dequant: \
      --variant w8a16:HYLO_FP8_DEQUANT_ROWS=0 --out "$out" 2>&1 | tail -3
    timeout 120 python3 tools/ab_decode.py --bs 1 8 64 --variant bf16:AB_MODEL=bench-6b \
      --variant fp8:AB_MODEL=bench-6b-fp8 --variant fp8-narrow:AB_MODEL=bench-6b-fp8,HYLO_FP8_WIDE_TILES=0 \
      --out "$out" 2>&1 | tail -4
    ;;
  s28)  # session 28's first call: the segmented scan's GPU tests and its A/B on Nemotron 3 Nano's 8192-token
        # prefill (issue 36); then on an H200 the 80B FP8 records (issue 37), else Nemotron 3 Nano's records
    timeout 70 python3 -m pytest -q -p no:cacheprovider $par tests/gpu/test_kernels_mamba2.py > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -5
    timeout 140 python3 tools/ab_decode.py --model-name nemotron-3-nano-30b-a3b --prefill 8192 --variant segments: \
      --variant whole:HYLO_MAMBA2_SEGMENTS=0 --out "$out" 2>&1 | tail -3
    big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100 * 2 ** 30))")
    if [ "$big" = 1 ]; then bench 330 --model-name qwen3-next-80b-fp8 --short
    else bench 330 --model-name nemotron-3-nano-30b-a3b --short; fi
    ;;
  s28b)  # session 28's second call: the FP8 one-row tiles widened (A/B on bench-6b-fp8), then one graph-replayed
         # batch-1 step of bench-6b-fp8 and of bench-6b kernel by kernel (which FP8 kernels fall short of their bytes)
    timeout 100 python3 tools/ab_decode.py --model-name bench-6b-fp8 --bs 1 8 --variant w1: \
      --variant w2:HYLO_FP8_ROW_WIDEN=2 --out "$out" 2>&1 | tail -3
    for m in bench-6b-fp8 bench-6b; do
      mkdir -p "$out/$m"
      timeout 110 python3 tools/profile_step.py --graphs --launches --bs 1 --model-name $m --out "$out/$m" \
        > "$out/$m/prof_step.txt" 2>&1
      grep -E "^==|launches,|^ +[0-9.]+ ms" "$out/$m/prof_step.txt" | head -24
    done
    ;;
  s28c)  # session 28's last call: the FP8 GPU tests with the b / a rows in the FP8 GEMV's launch, its A/B on
         # bench-6b-fp8; then on an H200 the 80B FP8 records (issue 37), else the 35B FP8 ones
    timeout 90 python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k fp8 > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -8
    timeout 100 python3 tools/ab_decode.py --model-name bench-6b-fp8 --bs 1 8 --variant tail: \
      --variant apart:HYLO_FP8_TAIL_ROWS=0 --out "$out" 2>&1 | tail -3
    big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100 * 2 ** 30))")
    if [ "$big" = 1 ]; then bench "${S28C_BENCH_S:-230}" --model-name qwen3-next-80b-fp8 --short
    else bench "${S28C_BENCH_S:-230}" --model-name qwen3.5-35b-a3b-fp8 --short; fi
    ;;
  s29)  # session 29: s28c's steps with FP8 against bfloat16 in the same A/B (issue 37's batch-1 target), then on an
         # H200 the 80B FP8 records, else the 35B FP8 ones
    timeout 90 python3 -m pytest -q -p no:cacheprovider $par tests/gpu -k fp8 > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -8
    timeout 130 python3 tools/ab_decode.py --bs 1 8 --variant bf16:AB_MODEL=bench-6b \
      --variant fp8:AB_MODEL=bench-6b-fp8 --variant fp8-apart:AB_MODEL=bench-6b-fp8,HYLO_FP8_TAIL_ROWS=0 \
      --out "$out" 2>&1 | tail -4
    big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100 * 2 ** 30))")
    if [ "$big" = 1 ]; then bench "${S29_BENCH_S:-300}" --model-name qwen3-next-80b-fp8 --short
    else bench "${S29_BENCH_S:-300}" --model-name qwen3.5-35b-a3b-fp8 --short; fi
    ;;
  s29-80b)  # on an H200: the 80B FP8 records first (issue 37), then FP8 against bfloat16 at bench-6b's shape on this card
    bench "${S29_BENCH_S:-420}" --model-name qwen3-next-80b-fp8 --short
    timeout 110 python3 tools/ab_decode.py --bs 1 8 --variant bf16:AB_MODEL=bench-6b \
      --variant fp8:AB_MODEL=bench-6b-fp8 --out "$out" 2>&1 | tail -3
    ;;
  s29-tiles)  # the MoE pair kernels' tiles for FP8 experts (their defaults were tuned on bfloat16 ones), bench-6b-fp8
    timeout 330 python3 tools/ab_decode.py --model-name bench-6b-fp8 --bs 1 8 --variant base: \
      --variant gu4w4:HYLO_PAIR_GATE_UP_CFG=4,1024,4,2 --variant gu8w4:HYLO_PAIR_GATE_UP_CFG=8,1024,4,2 \
      --variant gu4k512:HYLO_PAIR_GATE_UP_CFG=4,512,2,2 --variant ds2:HYLO_PAIR_DOWN_SUM_CFG=2,512,1,1 \
      --variant ds2w2:HYLO_PAIR_DOWN_SUM_CFG=2,512,2,1 --variant ds4w2:HYLO_PAIR_DOWN_SUM_CFG=4,512,2,1 \
      --variant widen4:HYLO_FP8_ROW_WIDEN=4 --out "$out" 2>&1 | tail -10
    ;;
  s29-final)  # the FP8 down-sum tile past one token (new default) against the bfloat16 one, bench-6b-fp8; then the
              # 80B FP8 records on an H200, else the 35B FP8 ones
    timeout 100 python3 tools/ab_decode.py --model-name bench-6b-fp8 --bs 1 8 --variant fp8: \
      --variant old-tile:HYLO_PAIR_DOWN_SUM_FP8_CFG=1,512,1,1 --out "$out" 2>&1 | tail -3
    big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100 * 2 ** 30))")
    if [ "$big" = 1 ]; then bench "${S29_BENCH_S:-330}" --model-name qwen3-next-80b-fp8 --short
    else bench "${S29_BENCH_S:-330}" --model-name qwen3.5-35b-a3b-fp8 --short; fi
    ;;
  s30)  # session 30: the FP8 grouped table's test, its sweep on the card's shape (80B on an H200, else 35B), then
         # that shape's FP8 bench with the sweep's winners, in the time left of the call's 600 s
    timeout 60 python3 -m pytest -q -p no:cacheprovider tests/gpu/test_kernels_fp8.py -k "grouped" \
      > "$out/gputests.txt" 2>&1
    echo "pytest rc=$?"; grep -E "passed|failed|FAILED|Error" "$out/gputests.txt" | tail -5
    big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100 * 2 ** 30))")
    tune() {  # tune SHAPE LIMIT (S30_TOKENS: the sizes swept, 256 alone for a short budget)
      timeout "$2" python3 tools/tune_fp8.py --shape "$1" --tokens ${S30_TOKENS:-256 64} --out "$out" \
        --env "$out/tuned.env" > "$out/tune_fp8.txt" 2>&1
      echo "tune rc=$?"; grep -v "^    " "$out/tune_fp8.txt" | tail -16
    }
    end=${S30_END_S:-585}  # seconds into the call by which everything has ended (the device's limit is 600)
    if [ "$big" = 1 ]; then  # the 80B records have never run: they come first, with the committed tiles
      bench $((end - ${S30_TUNE_RESERVE:-150} - SECONDS)) --model-name qwen3-next-80b-fp8 --short
      tune 80b $((end - SECONDS))
    else
      if [ "${S30_TUNE_ONLY:-0}" = 1 ]; then tune 35b $((end - SECONDS)); else  # (the sweep is its own A/B)
        tune 35b $(((end - SECONDS) * 2 / 5)); [ -f "$out/tuned.env" ] && . "$out/tuned.env"
        bench $((end - SECONDS)) --model-name qwen3.5-35b-a3b-fp8 --short
      fi
    fi
    ;;
  s32)  # session 32's open questions: on an H200 s30's (the 80B FP8 records, never run, then the 80B sweep);
         # elsewhere whether FP8 projections of 128 to 511 rows (a verify's) go faster dequantized for cuBLAS than
         # through the W8A16 matmul (HYLO_FP8_DEQUANT_ROWS 512, the default, against 128), bench-6b-fp8 and the 35B
         # FP8 shape, each variant a fresh process in the same call
    big=$(python3 -c "import torch; print(int(torch.cuda.get_device_properties(0).total_memory > 100 * 2 ** 30))")
    if [ "$big" = 1 ]; then
      exec bash "$0" s30 "$out"
    else
      for model in bench-6b-fp8 qwen3.5-35b-a3b-fp8; do
        for rows in 512 128; do
          mkdir -p "$out/$model-rows$rows"
          HYLO_FP8_DEQUANT_ROWS=$rows timeout 110 python3 -m hylo bench --pdl --model-name "$model" --short \
            --out "$out/$model-rows$rows" > "$out/$model-rows$rows.txt" 2>&1
          echo "== $model HYLO_FP8_DEQUANT_ROWS=$rows rc=$?"
          grep -E "prefill|bs=(8|64) ctx=1024|spec" "$out/$model-rows$rows.txt"
        done
      done
    fi
    ;;
  *) echo "unknown phase $phase" >&2; exit 2 ;;
esac
