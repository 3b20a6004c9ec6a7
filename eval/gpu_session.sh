#!/usr/bin/env bash
# One device call's worth of GPU checks and benchmarks, each under its own time limit, results packed
# into one archive (the device tool returns at most 8 files).
#
#   bash eval/gpu_session.sh OUT_DIR STEP...      e.g.  bash eval/gpu_session.sh $OUT tests kernel e2e
#
# Steps and their wall time on one H200 (2026-11-30): tests 55 s (compiled kernel tests, 8 workers),
# graph / graph-4b (issue 7's CUDA-graph decode benchmark, one model each),
# tune 4 min (batches 1, 8, 32), kernel 50 s, e2e 140 s per model for 2 contexts and 3 caches (here
# 3 and 4: expect ~280 s), memory 100 s (both models), multigpu 100 s (needs 2 GPUs), profile 60 s.
# A device call may run 10 minutes.
# Results land in OUT_DIR/results.tgz (JSON, markdown, PNG and a log per step); unpack them into
# eval/results/ to commit.
set -uo pipefail
out=$1
mkdir -p "$out"
shift
work=$(mktemp -d)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench="python3 eval/bench_gpu.py --out $work"

run() {  # run NAME SECONDS COMMAND...: log to $work/NAME.log, print its tail, repack the archive
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$work/$name.log" 2>&1
    echo "== $name (exit $?)"
    tail -n 12 "$work/$name.log"
    tar czf "$out/results.tgz" -C "$work" .
}

for step in "$@"; do
    case $step in
        tests) run tests 150 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels.py tests/test_static.py ;;
        tune) run tune 300 python3 eval/tune_decode.py --out "$work" ;;
        kernel) run kernel 120 $bench --config eval/configs/bench_kernel.json ;;
        e2e | e2e-4b)
            model=qwen3-8b name=bench_e2e
            [ "$step" = e2e-4b ] && model=qwen3-4b name=bench_e2e_4b
            run "$step" 420 $bench --config eval/configs/bench_e2e.json --name $name --set "models=[\"$model\"]" \
                --set decode.repeats=2 --set decode.new_tokens=16 ;;
        graph | graph-4b)  # GRAPH_SETS: extra --set arguments, e.g. to pick contexts
            model=qwen3-8b name=bench_graph
            [ "$step" = graph-4b ] && model=qwen3-4b name=bench_graph_4b
            run "$step" 480 $bench --config eval/configs/bench_graph.json --name $name --set "models=[\"$model\"]" \
                ${GRAPH_SETS:-} ;;
        memory) run memory 200 $bench --config eval/configs/bench_memory.json --set max_batch.max_attempts=3 \
                    --set max_batch.probe_up=false ;;
        multigpu) run multigpu 200 $bench --config eval/configs/bench_multigpu.json ;;
        profile) run profile 120 python3 eval/profile_decode.py --out "$work" ;;
        *) echo "unknown step $step" >&2 ;;
    esac
done
