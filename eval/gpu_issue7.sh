#!/usr/bin/env bash
# Issue 7's GPU evidence in one device call: the static-decoding GPU tests, the CUDA-graph benchmark on
# Qwen3-4B (32K/64K/100K) and Qwen3-8B at 64K (its 32K/100K rows come from bench_graph.json's own run).
#   bash eval/gpu_issue7.sh OUT_DIR      results in OUT_DIR/results.tgz
set -uo pipefail
out=$1
work=$(mktemp -d)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
bench="python3 eval/bench_gpu.py --out $work --config eval/configs/bench_graph.json"
caches='caches=["dynamic","oscar-int2","oscar-int2+graph","oscar-int2+absorbed+graph+compile"]'
step() {  # step NAME SECONDS COMMAND...
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$work/$name.log" 2>&1
    echo "== $name (exit $?)"
    tail -n 4 "$work/$name.log"
    tar czf "$out/results.tgz" -C "$work" .
}
step gpu_test_static 170 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_static.py tests/test_kernels.py \
    -k "static or window or compiled"
step graph_4b 290 $bench --name bench_graph_4b --set 'models=["qwen3-4b"]' --set "$caches"
step graph_8b_64k 120 $bench --name bench_graph_8b_64k --set 'models=["qwen3-8b"]' --set 'contexts=[65536]' \
    --set "$caches" --set 'compiled_static.models=[]' --set 'profile.model="none"'
