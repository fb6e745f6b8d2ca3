#!/usr/bin/env bash
# Issue 16's measurements as device calls (the `device` tool's `run`, from the repository root; each call at most
# 600 s, so at most the parts named on one line per call):
#
#   LORAPLEX_COMMIT=<sha> bash benchmarks/gpu_issue16.sh gemm-tests gemm gemm-decode    # call 1, ~9 min
#   LORAPLEX_COMMIT=<sha> bash benchmarks/gpu_issue16.sh tests persistent decode        # call 2, ~9 min
#   LORAPLEX_COMMIT=<sha> bash benchmarks/gpu_issue16.sh attention online               # call 3, ~5 min (carry .whl)
#
# Parts (each under its own `timeout`, output in $OUT/<part>.log, the benchmarks' JSON in $OUT):
#   gemm-tests   dense_linear's GPU tests (split-K and stream-K in graphs under PDL, bitwise against eager)
#   gemm         the decode GEMMs at 32, 64 and 128 tokens (Llama-2-7B): cuBLAS, the tiled kernels and stream-K
#                (one and two programs per SM, one per tile; pointer and TMA loads); $OUT/dense_merged.json is
#                MEASURED_CONFIGS with this run's verdict on every shape it measured
#   gemm-decode  the decode table's base rows with that table, then without it (A/B in one call)
#   tests        the GPU tests of decode attention, mixed and decode graphs, DoRA and the folded shrink
#   decode       the decode table (issue 16's goal rows, base and 32 adapters, profiled), max_model_len 4096
#   attention    the paged decode attention grid (Llama-2 and Llama-3 heads, contexts 128 and 1k, batch 1-256)
#   persistent   decode attention at batch 32 and 128, contexts 128-192: the engine kernel, the persistent kernel
#                over host lists (session 29's best setting) and the stream-K kernel (device-side ranges)
#   online       REST serving, 100 adapters, rates 32-96 req/s (needs the wheels of benchmarks/online_wheels.txt
#                in .whl, carried: `run(carry=[".whl"])`)
# Commands as in benchmarks/RESULTS.md, sessions 22-30.
source "$(dirname "$0")/gpu_parts.sh"

DECODE=(benchmarks/bench_decode.py --max-model-len 4096 --batches 1 32 128 --async-modes on --profile-steps 4)
for part in "$@"; do
    case $part in
        gemm-tests) run gemm-tests 120 "$PY" -m pytest -q -p no:cacheprovider -rfE \
                        tests/kernels/test_dense_linear_kernel.py ;;
        gemm) run gemm 330 "$PY" benchmarks/diag_dense_linear.py --models llama2 --tokens 32,64,128 \
                  --streamk 132,264,tiles --jobs 14 --out "$OUT/dense.json" --merged "$OUT/dense_merged.json" ;;
        gemm-decode)
            if [ -s "$OUT/dense_merged.json" ]; then
                run gemm-decode 200 "$PY" "${DECODE[@]}" --kinds base --dense-configs "$OUT/dense_merged.json" \
                    --out "$OUT/decode_merged.json"
            fi
            run gemm-decode-ref 200 "$PY" "${DECODE[@]}" --kinds base --out "$OUT/decode_ref.json" ;;
        tests) run tests 240 "$PY" -m pytest -q -p no:cacheprovider -rfE tests/kernels/test_paged_attention_kernels.py \
                   tests/engine/test_mixed_cuda_graphs.py tests/engine/test_dora_gpu.py \
                   tests/engine/test_folded_shrink_gpu.py ;;
        decode) run decode 300 "$PY" "${DECODE[@]}" --kinds base,mixed --out "$OUT/decode.json" ;;
        persistent) run persistent 240 "$PY" benchmarks/diag_persistent_decode.py --programs-per-sm 4 --stages 2,3 \
                        --tiles 32,64 --bodies top --streamk 2,3,4 --out "$OUT/persistent.json" ;;
        attention) run attention 200 "$PY" benchmarks/bench_attention.py --models llama2,llama3 --contexts 128,1024 \
                       --batches 1,32,128,256 --no-mixed --out "$OUT/attention.md" ;;
        online)
            "$PY" -m pip install -q --no-deps --target /tmp/wh .whl/*.whl > "$OUT/wheels.log" 2>&1
            run online 300 env PYTHONPATH=.:/tmp/wh "$PY" benchmarks/bench_online.py --seconds-per-rate 6 \
                --async-scheduling --rates 32,64,80,96 --out "$OUT/online.json" ;;
        *) echo "unknown part: $part (gemm-tests, gemm, gemm-decode, tests, decode, persistent, attention, online)"
           exit 2 ;;
    esac
done
