#!/usr/bin/env bash
# Issue 17's goals at one commit, as device calls (the `device` tool's `run`, from the repository root):
#
#   LORAPLEX_COMMIT=<sha> bash benchmarks/gpu_issue17.sh tests decode ranks disk    # call 1, ~8 min
#   LORAPLEX_COMMIT=<sha> bash benchmarks/gpu_issue17.sh scaling                    # call 2, ~5 min (+cold: ~7)
#
# Parts (each under its own `timeout`, output in $OUT/<part>.log, the benchmarks' JSON in $OUT):
#   tests    the LoRA consumer and folded-shrink GPU tests (PEFT-exact mixed batches, every consumer setting)
#   decode   goals 1-2: base and 32 x r16 on all 7 projections at batches 1, 32, 128, profiled (LoRA ms per step)
#   ranks    goal 4: mixed ranks (24 x r8, 4 x r16, 4 x r64) against 32 x r16 in a pool of 64 pages of 8 rows
#   disk     goal 3: disk -> slot of one 16.8 MB q/v adapter, where the time goes
#   scaling  goal 3: 512 and 2,000 adapters, uniform and Zipf, q/v r=16, async scheduling (no cold row)
#   cold     goal 3: the same with the cold-start row (first read of every adapter inside the run)
# Commands as in benchmarks/RESULTS.md, sessions 16-24.
source "$(dirname "$0")/gpu_parts.sh"

for part in "$@"; do
    case $part in
        tests) run tests 150 "$PY" -m pytest -q -p no:cacheprovider tests/kernels/test_lora_delta.py \
                   tests/engine/test_folded_shrink_gpu.py ;;
        decode) run decode 200 "$PY" benchmarks/bench_decode.py --async-modes on --profile-steps 4 \
                    --kinds base,mixed --batches 1 32 128 ;;
        ranks) run ranks 200 "$PY" benchmarks/bench_decode.py --async-modes on --profile-steps 4 \
                   --kinds base,mixed,mixed-ranks --lora-page-rows 8 --lora-fold-shrink on --max-lora-pages 64 \
                   --batches 1 32 128 ;;
        disk) run disk 90 "$PY" benchmarks/diag_disk_to_slot.py ;;
        scaling) run scaling 420 "$PY" benchmarks/bench_serving.py --parts scaling --scaling-counts 512,2000 \
                     --no-cold --lora-target-modules q_proj,v_proj --async-scheduling ;;
        cold) run cold 560 "$PY" benchmarks/bench_serving.py --parts scaling --scaling-counts 512,2000 \
                  --lora-target-modules q_proj,v_proj --async-scheduling ;;
        *) echo "unknown part: $part (tests, decode, ranks, disk, scaling, cold)"; exit 2 ;;
    esac
done
