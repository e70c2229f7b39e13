#!/usr/bin/env bash
# The GPU run, in one call of the device tool: tests on CUDA, then benchmarks.
#   scripts/gpu_check.sh [tests] [bench] [bench-bf16] [bench-hf] [bench-demo] [bench-step] [tune] [tune-fast] [fast] [train-demo] [train-mtp] [ncu] [sanitize] [graphs] [profile-hf] [diag-fla] [diag-loop] [forward-cost] [round-cost] [tp]     (default: tests bench)
#   GPU_TESTS="tests/hf tests/ops/gdn/test_ops.py ..." limits the tests part to those folders and files (default: tests/)
#   GPU_TEST_GROUPS="tests/a.py tests/b|tests/c/d.py" (files or folders) runs each group in its own pytest process at
#   the same time instead (the whole -m gpu suite takes over 10 minutes in one process), each
#   with nproc / groups OpenMP threads and at most GPU_TEST_TIMEOUT seconds (unset: no limit);
#   GPU_TEST_GROUPS=auto: nine groups balanced by measured times, every test file in one
#   tp (2 or more GPUs): the NCCL tensor-parallel tests, the captured step at TP 1 and N and its
#   plot, Hugging Face generate at TP N, for N in TP_SIZES (default: 2 and 4, those the machine
#   has); TP_TESTS=0 skips the tests; all of it in $OUT/tp/ (the merged step JSON and PNG and the
#   HF JSON per TP size, ready to commit to benchmarks/results/tp/; each step run's JSON and the logs
#   in runs.tar.gz: 5 files with TP 2 and 4, 7 with gpu.txt and triton_autotune.tar.gz, within the
#   device tool's 8). NCCL variables are left as the machine sets them.
# Writes logs and benchmark JSON/PNG under $OUT and prints a short table last.
# fp32 exactness is compared with IEEE fp32 dots (TRITON_F32_DEFAULT=ieee; the test
# conftest also turns cuDNN/cuBLAS TF32 off).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ssm_spec_gpu}
mkdir -p "$OUT" "$OUT/tune" "$OUT/ncu"
OUT=$(cd "$OUT" && pwd)  # absolute: some parts write from other directories
export TRITON_F32_DEFAULT=ieee PYTHONUNBUFFERED=1
# the checkout installed as the package (editable, no dependencies: the machine has them), so that
# ssm_spec.graphs maps to graphs/ as pyproject.toml says, wherever a script or test runs from
python3 -m pip show ssm-spec >/dev/null 2>&1 \
  || python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null || { echo "installing the checkout failed"; exit 2; }
PARTS=${*:-tests bench}
# carried wheels (fla-core for the chunked prefill): prepare them here with
#   pip download --no-deps -d .whl "fla-core>=0.6" einops     (pure-Python wheels)
# and name .whl in the device tool's carry
if ls .whl/*.whl >/dev/null 2>&1; then
  # two parts started at once share one install (a second --upgrade would rewrite it under the first)
  [ -f /tmp/site/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && touch /tmp/site/.installed; }
  [ -f /tmp/site/.installed ] && export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}/tmp/site"
fi
# another transformers release (the machine has 5.17): TF_WHEELS=.whl525 names a folder of carried
# wheels (transformers==5.25.0, huggingface_hub>=2.4 and what they need; name it in carry too),
# installed apart and put first on the path; its `kernels` dependency is not carried
# (USE_HUB_KERNELS=0 tells transformers not to use it)
if [ -n "${TF_WHEELS:-}" ]; then
  [ -f /tmp/site-tf/.installed ] || { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site-tf "$TF_WHEELS"/*.whl && touch /tmp/site-tf/.installed; }
  export PYTHONPATH="/tmp/site-tf${PYTHONPATH:+:$PYTHONPATH}" USE_HUB_KERNELS=0
fi
# Triton autotuning results: fla-core tunes each of its kernels on first use (every config
# compiled and timed: one to two minutes per process on a fresh machine, seen on the H200).
# fla-core builds its autotuners with cache_results=False, so Triton keeps the winners on disk
# (<kernel>.autotune.json) only with TRITON_CACHE_AUTOTUNING=1; later processes on the machine
# then skip the tuning. The run returns Triton's cache in $OUT/triton_autotune.tar.gz (the whole
# cache, compiled kernels too, when it packs under 15 MB; else the winners alone); copy that
# file to .gpu_cache/ here and name .gpu_cache in the device tool's carry, and the next machine
# neither tunes nor compiles those kernels again.
export TRITON_CACHE_AUTOTUNING=1
TRITON_CACHE=${TRITON_CACHE_DIR:-$HOME/.triton/cache}
if [ -f .gpu_cache/triton_autotune.tar.gz ]; then
  mkdir -p "$TRITON_CACHE" && tar -C "$TRITON_CACHE" -xzf .gpu_cache/triton_autotune.tar.gz \
    && echo "Triton cache carried in: $(tar -tzf .gpu_cache/triton_autotune.tar.gz | grep -c autotune.json) autotune results, $(tar -tzf .gpu_cache/triton_autotune.tar.gz | wc -l) files"
fi
# torch.compile's caches likewise (inductor's compiled graphs and the Triton kernels it wrote; the
# compiled decode loop's first calls at a realistic width compile for minutes, docs/perf-notes.md):
# returned as $OUT/inductor_cache.tar.gz when it packs under 15 MB, carried in from .gpu_cache/ as
# the Triton cache is.
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/ssm_spec_inductor}
if [ -f .gpu_cache/inductor_cache.tar.gz ]; then
  mkdir -p "$TORCHINDUCTOR_CACHE_DIR" && tar -C "$TORCHINDUCTOR_CACHE_DIR" -xzf .gpu_cache/inductor_cache.tar.gz \
    && echo "inductor cache carried in: $(tar -tzf .gpu_cache/inductor_cache.tar.gz | wc -l) files"
fi
save_autotune() {
  if [ -d "$TORCHINDUCTOR_CACHE_DIR" ]; then
    (cd "$TORCHINDUCTOR_CACHE_DIR" && tar -czf "$OUT/inductor_cache.tar.gz" . \
      && [ "$(stat -c %s "$OUT/inductor_cache.tar.gz")" -lt 15000000 ] \
      || { rm -f "$OUT/inductor_cache.tar.gz"; echo "inductor cache not returned: over 15 MB packed"; })
  fi
  [ -d "$TRITON_CACHE" ] || return 0
  (cd "$TRITON_CACHE" && tar -czf "$OUT/triton_autotune.tar.gz" . \
    && [ "$(stat -c %s "$OUT/triton_autotune.tar.gz")" -lt 15000000 ] \
    || find . -name '*.autotune.json' | tar -czf "$OUT/triton_autotune.tar.gz" -T -)
}
trap save_autotune EXIT
summary=()
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv,noheader | tee "$OUT/gpu.txt"
python3 -c 'import torch, triton, transformers; print("torch", torch.__version__, "triton", triton.__version__, "transformers", transformers.__version__)' | tee -a "$OUT/gpu.txt"
for part in $PARTS; do
  case $part in
    tests)  # the CUDA variants (-m gpu); CI runs the CPU ones
      if [ -n "${GPU_TEST_GROUPS:-}" ]; then  # "a.py b.py|c.py|...": groups run at once (one GPU, 16 cores)
        if [ "$GPU_TEST_GROUPS" = auto ]; then
          # balanced by the times of a fresh H100 (docs/perf-notes.md): the slowest files alone, the
          # MTP file's two sharded-checkpoint cases apart from the rest of it; a test file added
          # later, in no group here, joins the last group
          sharded="tests/hf/test_mtp.py::test_greedy_with_the_mtp_head_equals_plain_greedy[cuda-sharded-qwen3_next]"
          sharded="$sharded ${sharded%\[*}[cuda-sharded-qwen3_5]"
          groups=("tests/ops" "tests/reference tests/modules tests/graphs tests/test_*.py"
                  "tests/hf/test_device_map.py tests/hf/test_graphs.py tests/hf/test_generate.py"
                  "tests/hf/test_cli_generate.py tests/hf/test_rollback.py tests/hf/test_fused_linear.py tests/hf/test_fast_mode.py"
                  "tests/hf/test_model_classes.py" "tests/hf/test_loop_compile.py tests/hf/test_decode_loop.py"
                  "tests/hf/test_mtp.py $(printf -- '--deselect=%s ' $sharded)" "$sharded" "")
        else
          IFS='|' read -ra groups <<< "$GPU_TEST_GROUPS"
        fi
        shopt -s globstar
        for f in tests/**/test_*.py; do  # a file in no group would be skipped silently
          [[ $f == tests/interpret/* ]] && continue  # .ci/run's interpreter process; never under -m gpu
          covered=0
          for g in ${groups[*]}; do [[ $f == $g || $f == "${g%/}"/* ]] && covered=1; done
          [ "$covered" = 1 ] && continue
          if [ "$GPU_TEST_GROUPS" = auto ]; then last=$(( ${#groups[@]} - 1 )); groups[$last]="${groups[$last]:+${groups[$last]} }$f"
          else echo "note: $f is in no GPU_TEST_GROUPS group"; fi
        done
        [ -n "${groups[-1]}" ] || unset 'groups[-1]' 
        # each group its share of the cores: oversubscribed OpenMP threads slowed the CPU halves
        # of the device-map tests many times over; GPU_TEST_TIMEOUT (seconds) bounds each group (a
        # fresh machine compiles every Triton kernel and inductor graph on first use: with the whole
        # suite in seven groups and no Triton cache carried, none had finished at 160 s on an H100)
        # the cut is a SIGINT, so pytest prints the failures and errors it has seen (a KILL 30 s
        # later if it does not stop: blocked in a CUDA call, say)
        threads=$(( $(nproc) / ${#groups[@]} )); [ "$threads" -ge 1 ] || threads=1
        pids=()
        for i in "${!groups[@]}"; do
          OMP_NUM_THREADS=$threads ${GPU_TEST_TIMEOUT:+timeout -s INT -k 30 "$GPU_TEST_TIMEOUT"} \
            python3 -m pytest -q -rfE -p no:cacheprovider -m gpu ${groups[$i]} > "$OUT/tests_group$i.log" 2>&1 &
          pids+=($!)
        done
        : > "$OUT/tests.log"
        for i in "${!pids[@]}"; do
          wait "${pids[$i]}"; rc=$?
          # pytest's 5: the group holds no -m gpu test (a file of CPU tests only), not a failure
          case $rc in 0) status=ok ;; 5) status="no GPU tests" ;; 124|137) status="TIMED OUT (GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-})" ;; *) status="FAILED (rc $rc)" ;; esac
          summary+=("tests group $i [$status] (${groups[$i]}): $(tail -n 1 "$OUT/tests_group$i.log")")
          { echo "===== group $i: ${groups[$i]} (rc $rc)"; cat "$OUT/tests_group$i.log"; } >> "$OUT/tests.log"
          rm -f "$OUT/tests_group$i.log"
        done
        grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 40
      else
        python3 -m pytest -q -p no:cacheprovider -m gpu ${GPU_TESTS:-tests} 2>&1 | tee "$OUT/tests.log"
        summary+=("tests: $(tail -n 1 "$OUT/tests.log")")
      fi
      python3 -m ssm_spec selfcheck 2>&1 | tee "$OUT/selfcheck.log"
      summary+=("selfcheck: $(tail -n 1 "$OUT/selfcheck.log")")
      ;;
    bench)
      python3 benchmarks/bench_ops.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_fp32.log"
      summary+=("bench fp32: see table above ($OUT/bench_fp32.log)")
      ;;
    bench-hf)
      python3 benchmarks/bench_hf_generate.py --out-dir "$OUT" ${BENCH_HF_ARGS:-} 2>&1 | tee "$OUT/bench_hf.log"
      summary+=("bench hf: $OUT/bench_hf.log")
      ;;
    bench-demo)  # the packaged demo pair on held-out code: acceptance and tokens/s, eager and graphed
      python3 benchmarks/bench_hf_generate.py --model demo --out-dir "$OUT" ${BENCH_DEMO_ARGS:-} 2>&1 | tee "$OUT/bench_demo.log"
      summary+=("bench demo: $(grep -E "^graphs\+(lookup|draft)" "$OUT/bench_demo.log" | tr '\n' ';')")
      ;;
    diag-loop)  # does the decode loop's round capture on this width, and if not, every sync in it (DIAG_LOOP_ARGS: bench_hf_generate's width flags)
      python3 scripts/diag_loop_capture.py ${DIAG_LOOP_ARGS:-} 2>&1 | tee "$OUT/diag_loop.log"
      summary+=("diag loop: $(tail -n 1 "$OUT/diag_loop.log")")
      ;;
    forward-cost)  # decode / verify forwards: separate vs fused projections, eager vs compiled; GEMV backends (FORWARD_COST_ARGS: bench_hf_generate's width flags)
      python3 scripts/forward_cost.py ${FORWARD_COST_ARGS:-} --out "$OUT/forward_cost.json" 2>&1 | tee "$OUT/forward_cost.log"
      python3 benchmarks/bench_gemv.py --out-dir "$OUT" ${GEMV_ARGS:-} 2>&1 | tee "$OUT/gemv.log"
      summary+=("forward cost: $OUT/forward_cost.log; gemv: $OUT/gemv.log")
      ;;
    round-cost)  # the decode loop's time part by part: prefill, captured rounds, the rest (ROUND_COST_ARGS: bench_hf_generate's width flags, --compile off|on|both, --mtp-k K)
      python3 scripts/loop_round_cost.py ${ROUND_COST_ARGS:-} --json "$OUT/round_cost.json" 2>&1 | tee "$OUT/round_cost.log"
      summary+=("round cost: $OUT/round_cost.log")
      ;;
    bench-step)  # captured step: RecoverSSM vs snapshot vs folded, B 1..256, k 1 3 5
      python3 benchmarks/bench_step.py --out-dir "$OUT" 2>&1 | tee "$OUT/bench_step.log"
      summary+=("bench step: $OUT/bench_step.log")
      ;;
    tune)  # GDN tiles per batch size: verify / commit / snapshot times, commit == snapshot, bits across tiles
      # TUNE_RUNS="B k dtype tiles;..." (tiles 'BV:warps,...'; empty: every candidate)
      IFS=';' read -ra runs <<< "${TUNE_RUNS:-1 3 float32 8:1,16:1,32:1;4 3 float32 8:1,16:1,32:1;16 3 float32 16:1,32:1,64:2;64 3 float32 16:1,32:1,32:2,64:2,64:4,128:4;256 3 float32 16:1,32:1,64:2;64 1 float32 16:1,32:1,64:2;64 5 float32 16:1,32:1,64:2;64 3 bfloat16 16:1,32:1,32:2,64:2;4 3 bfloat16 8:1,16:1,32:1}"
      for r in "${runs[@]}"; do
        read -r b k dt tiles <<< "$r"
        name="tune_b${b}_k${k}_$dt"
        python3 scripts/tune_gdn.py --batch "$b" --k "$k" --state-dtype "$dt" ${tiles:+--tiles "$tiles"} \
          --out "$OUT/tune/$name.json" > "$OUT/tune/$name.log" 2>&1
        summary+=("$name: $(grep -E "^fastest|bit-identical" "$OUT/tune/$name.log" | tr '\n' ';')")
      done
      ;;
    tune-fast)  # fast mode's closed-form kernel: tiles per batch and window, bits across tiles
      # TUNE_FAST_RUNS="batches windows dtype tiles;..." (tiles 'BV:warps,...')
      IFS=';' read -ra runs <<< "${TUNE_FAST_RUNS:-64 2,4,8 float32 8:1,16:1,32:1,32:2,64:2,64:4;64 4 bfloat16 16:1,32:1,32:2,64:2}"
      for r in "${runs[@]}"; do
        read -r b w dt tiles <<< "$r"
        name="tune_fast_b${b//,/-}_w${w//,/-}_$dt"
        python3 scripts/tune_closed_form.py --batch "$b" --windows "$w" --state-dtype "$dt" ${tiles:+--tiles "$tiles"} \
          --out "$OUT/tune/$name.json" > "$OUT/tune/$name.log" 2>&1
        summary+=("$name: $(grep -E "^best|FAIL" "$OUT/tune/$name.log" | tr '\n' ';')")
      done
      ;;
    fast)  # fast mode's committed numbers (benchmarks/results/fast_mode/): B=64, k=3, fp32 and bf16 state
      # the tuning run at the launch's defaults; FAST_TILES (BV:warps,...) / FAST_CAPS / FAST_RING_KC /
      # FAST_PLAIN_KC / FAST_STAGES / FAST_PREFETCH (comma lists) sweep the tile, the register cap, the
      # ring and plain forms' key rows per chunk, the state loop's stages and its loads a chunk ahead
      # (0,1); FAST_BENCH=0: the tuning run only
      mkdir -p "$OUT/fast_mode"
      python3 scripts/tune_closed_form.py --batch 64 --windows 2,4,8 --tiles "${FAST_TILES:-128:1}" ${FAST_CAPS:+--max-registers "$FAST_CAPS"} \
        ${FAST_RING_KC:+--ring-key-rows "$FAST_RING_KC"} ${FAST_PLAIN_KC:+--plain-key-rows "$FAST_PLAIN_KC"} \
        ${FAST_STAGES:+--stages "$FAST_STAGES"} ${FAST_PREFETCH:+--prefetch "$FAST_PREFETCH"} \
        --out "$OUT/fast_mode/tune_closed_form_b64_w2-4-8_float32.json" > "$OUT/fast_mode/tune.log" 2>&1
      summary+=("fast: $(grep -E "^best|FAIL" "$OUT/fast_mode/tune.log" | tr '\n' ';')")
      [ "${FAST_BENCH:-1}" = 0 ] && continue
      python3 benchmarks/bench_ops.py --batches 64 --k 3 --out-dir "$OUT/fast_mode" > "$OUT/fast_mode/bench_ops.log" 2>&1
      python3 benchmarks/bench_ops.py --batches 64 --k 3 --state-dtype bfloat16 --out-dir "$OUT/fast_mode" \
        > "$OUT/fast_mode/bench_ops_bf16.log" 2>&1
      python3 benchmarks/bench_step.py --batches 64 --k 3 --out-dir "$OUT/fast_mode" > "$OUT/fast_mode/bench_step.log" 2>&1
      ;;
    train-demo)  # the demo pair (scripts/train_demo_model.py), packed in one file for the device tool
      python3 scripts/train_demo_model.py --out "$OUT/demo" > "$OUT/train_demo.log" 2>&1
      tar -C "$OUT" -cf "$OUT/demo.tar" demo && rm -rf "$OUT/demo"
      summary+=("train-demo: $(grep -E "held-out bits per byte" "$OUT/train_demo.log")")
      ;;
    train-mtp)  # the demo target's MTP head (scripts/train_demo_mtp.py, TRAIN_MTP_ARGS), installed into this
      # machine's copy of the assets, then the demo bench's decode-loop runs with loop+mtp k 1..5 on it
      # (BENCH_MTP_ARGS); $OUT/demo_mtp.tar holds what --install needs here (target/model.safetensors,
      # target/config.json, mtp.json): untar it into a folder and run train_demo_mtp.py --install on that folder
      python3 scripts/train_demo_mtp.py --out "$OUT/demo_mtp" ${TRAIN_MTP_ARGS:-} > "$OUT/train_mtp.log" 2>&1 \
        && python3 scripts/train_demo_mtp.py --install "$OUT/demo_mtp" >> "$OUT/train_mtp.log" 2>&1
      rc=$?
      summary+=("train-mtp [$([ $rc -eq 0 ] && echo ok || echo "FAILED rc $rc")]: $(grep -E "^held-out acceptance" "$OUT/train_mtp.log")")
      if [ $rc -eq 0 ]; then
        python3 benchmarks/bench_hf_generate.py --model demo --loop-only --out-dir "$OUT" ${BENCH_MTP_ARGS:-} 2>&1 | tee "$OUT/bench_mtp.log"
        summary+=("bench mtp: $(grep -E "^(loop|loop\+mtp)( |:)" "$OUT/bench_mtp.log" | tr -s ' ' | tr '\n' ';')")
        tar -C "$OUT/demo_mtp" -cf "$OUT/demo_mtp.tar" target/model.safetensors target/config.json mtp.json
      fi
      rm -rf "$OUT/demo_mtp"
      ;;
    ncu)  # hardware counters of one launch per kernel: NCU="kernel:BV:warps ..." (or kernel:- for its table's tile)
      for spec in ${NCU:-verify:- commit:- snapshot:- folded:-}; do
        kern=${spec%%:*}; t=${spec#*:}
        case $kern in commit) regex=gdn_commit_kernel ;; native_engine) regex=native_engine_kernel ;; closed_form*|lazy*) regex=gdn_closed_form_kernel ;; *) regex=gdn_window_kernel ;; esac
        ncu --clock-control none -k regex:$regex -s 2 -c 1 --section SpeedOfLight --section Occupancy \
          --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
          python3 scripts/profile_gdn.py --kernel "$kern" ${t:+$([ "$t" != "-" ] && echo "--tile $t")} \
          > "$OUT/ncu/ncu_${kern}_${t/:/_}.txt" 2>&1
        summary+=("ncu $kern $t: $(grep -E "^ +(Duration|DRAM Throughput|Registers Per Thread|Achieved Occupancy|Issue Slots Busy) " "$OUT/ncu/ncu_${kern}_${t/:/_}.txt" | awk '{print $1"="$NF}' | tr '\n' ' ')")
      done
      ;;
    graphs)  # eager vs captured step time and host time, realistic widths, batch 1 16 64
      python3 examples/compile_graph_capture.py --json "$OUT/graphs_step.json" 2>&1 | tee "$OUT/graphs_step.log"
      summary+=("graphs step: $OUT/graphs_step.log")
      ;;
    profile-hf)
      python3 scripts/profile_hf_forward.py --out-dir "$OUT" 2>&1 | tee "$OUT/profile_hf.log"
      summary+=("profile hf: $(tail -n 3 "$OUT/profile_hf.log" | tr '\n' ';')")
      ;;
    diag-fla)
      python3 scripts/diag_fla_prefill.py 2>&1 | tee "$OUT/diag_fla.log"
      summary+=("diag fla: $OUT/diag_fla.log")
      ;;
    sanitize)  # compute-sanitizer memcheck and racecheck over every GDN and conv kernel (small shapes)
      for tool in memcheck racecheck; do
        compute-sanitizer --tool $tool --error-exitcode 1 python3 scripts/sanitize_kernels.py \
          > "$OUT/sanitize_$tool.log" 2>&1
        rc=$?
        summary+=("sanitize $tool [$([ $rc -eq 0 ] && echo ok || echo "FAILED rc $rc")]: $(grep -E "ERROR SUMMARY|sanitize_kernels:" "$OUT/sanitize_$tool.log" | tr '\n' ' ')")
      done
      ;;
    tp)  # tensor parallelism over NCCL, one process per GPU
      ngpu=$(nvidia-smi -L | wc -l)
      sizes=""
      for n in ${TP_SIZES:-2 4}; do [ "$ngpu" -ge "$n" ] && sizes="$sizes $n"; done
      if [ -z "$sizes" ]; then summary+=("tp: skipped ($ngpu GPU(s); needs 2 or more)"); continue; fi
      tp="$OUT/tp"; mkdir -p "$tp/logs"
      # The device tool's call ends at 600 s, and at the defaults this part is about that long (tests
      # 3-5 min, step runs 2 min, HF runs 4-5 min, estimated): no command of it starts after TP_END_S
      # seconds of this script (default 540) and each is cut there, so the merge, the archive and the
      # summary always happen. GPU_TEST_TIMEOUT (seconds) bounds the tests further.
      tp_end=${TP_END_S:-540}
      tp_timed() {  # LOG LIMIT cmd...: cmd's output into LOG, at most LIMIT s (0: no own limit) and never past tp_end
        local log=$1 limit=$2 left=$(( tp_end - SECONDS )); shift 2
        if [ "$limit" -gt 0 ] && [ "$limit" -lt "$left" ]; then left=$limit; fi
        if [ "$left" -lt 20 ]; then echo "not started: out of time (TP_END_S=$tp_end)" > "$log"; return 125; fi
        timeout --kill-after=15 "$left" "$@" > "$log" 2>&1
      }
      tp_launch() {  # N: the launcher of N processes (N = 1: plain python3), the environment as it is
        if [ "$1" -eq 1 ]; then echo python3; else echo "python3 -m torch.distributed.run --standalone --nproc-per-node $1"; fi
      }
      if [ "${TP_TESTS:-1}" != 0 ]; then
        tp_timed "$tp/logs/tests.log" "${GPU_TEST_TIMEOUT:-0}" python3 -m pytest -q -p no:cacheprovider -m gpu \
          tests/modules/test_tensor_parallel.py
        rc=$?
        summary+=("tp tests ($ngpu GPUs) [rc $rc]: $(tail -n 1 "$tp/logs/tests.log")")
        grep -E "^(FAILED|ERROR)" "$tp/logs/tests.log" | head -n 20
      fi
      for n in 1 $sizes; do
        # shellcheck disable=SC2046  # the launcher's words
        tp_timed "$tp/logs/bench_step_tp$n.log" 0 $(tp_launch "$n") benchmarks/bench_step_tp.py --out-dir "$tp" \
          ${BENCH_STEP_TP_ARGS:-}
        rc=$?
        summary+=("tp step TP $n [rc $rc]: $(grep -cE '^ *[0-9]+ +[0-9]+ \|' "$tp/logs/bench_step_tp$n.log") rows")
      done
      for n in $sizes; do
        # shellcheck disable=SC2046
        tp_timed "$tp/logs/bench_hf_tp$n.log" 0 $(tp_launch "$n") benchmarks/bench_hf_tp.py --out-dir "$tp" \
          ${BENCH_HF_TP_ARGS:-}
        rc=$?
        summary+=("tp hf TP $n [rc $rc]: $(grep -E '^(plain|lookup) ' "$tp/logs/bench_hf_tp$n.log" | tr -s ' ' | tr '\n' ';')")
      done
      python3 benchmarks/bench_step_tp.py --merge "$tp" --out-dir "$tp" > "$tp/logs/merge.log" 2>&1
      summary+=("tp merge: $(grep -E 'TP [0-9]+:' "$tp/logs/merge.log" | grep -v 'TP 1:' | awk '{print $1,$2,$3$4,$5,$6,$(NF)}' | tr '\n' ';')")
      # the device tool returns at most 8 files in all, gpu.txt and triton_autotune.tar.gz among them:
      # the step runs' own JSON (what the merge drew) go into runs.tar.gz with the logs
      (cd "$tp" && runs=$(ls bench_step_tp[0-9]*_*.json 2>/dev/null); tar -czf runs.tar.gz logs $runs && rm -rf logs $runs)
      ;;
    bench-bf16)
      python3 benchmarks/bench_ops.py --state-dtype bfloat16 --out-dir "$OUT" 2>&1 | tee "$OUT/bench_bf16.log"
      summary+=("bench bf16: $OUT/bench_bf16.log")
      ;;
    *) echo "unknown part: $part"; exit 2 ;;
  esac
done
echo
echo "== summary =="
for line in "${summary[@]}"; do echo "$line"; done
for log in "$OUT"/bench_*.log; do
  [ -f "$log" ] && { echo "-- $(basename "$log")"; grep -E '^ *[0-9]+ \|' "$log"; }
done
# the summary above says which part failed (each part records its own status); the script's own
# status is 0 once every part ran (an unknown part exits 2 above)
exit 0
