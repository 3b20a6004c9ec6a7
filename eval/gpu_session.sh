#!/usr/bin/env bash
# GPU checks and benchmarks for one device call: each step runs under its own time limit (the second
# argument of its `run` line) and its results are packed into one archive.
#
#   bash eval/gpu_session.sh OUT_DIR STEP...      e.g.  bash eval/gpu_session.sh $OUT tests kernel e2e
#
# Run from the repository root; the steps run in the order given. Pick steps whose limits fit in one
# device call. The steps:
#   GPU tests          tests (all GPU test files), gluon-tests, static-tests, threebit-tests, decode-graphs, gluon (the Gluon history span's
#                      tests, diagnosis and timing), multigpu-tests (2 GPUs)
#   benchmarks         kernel, kernel-bits, e2e, e2e-4b, e2e-100k, e2e-32k, graph, graph-4b, graph-8b-64k,
#                      graph-gemms, memory, multigpu (2 GPUs): eval/bench_gpu.py with eval/configs/bench_*.json
#   step-times         eval/step_times.py: every step of one generate call, freezing and capturing included
#   quality            eval/ablate.py with eval/configs/quality.json: memory, held-out KL/PPL, needles
#   levers             eval/ablate.py with eval/configs/levers.json: each part of the recipes against the recipe without it
#   calibration-cost   eval/calibration_cost.py: oscar_hf.calibrate's stages on the 8B shape, time and memory
#   kernel diagnostics tune, profile, timeline, timeline-32k, merge, floors, kernel-b1, alternating-rows, halves,
#                      registers, ncu, ncu-call: kernels/tools/ (see its README.md); ncu and ncu-call need
#                      Nsight Compute's `ncu` on PATH (e.g. /usr/local/cuda/bin)
# Results land in OUT_DIR/results.tgz (JSON, markdown, PNG and a log per step), repacked after every step so
# that a call cut short keeps what finished; unpack them into eval/results/ to commit.
set -uo pipefail
out=$1
mkdir -p "$out"
shift
work=$(mktemp -d)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
bench="python3 -m eval.bench_gpu --out $work"

run() {  # run NAME SECONDS COMMAND...: log to $work/NAME.log, print its tail, repack the archive
    local name=$1 limit=$2
    shift 2
    timeout "$limit" "$@" >"$work/$name.log" 2>&1
    echo "== $name (exit $?)"
    tail -n 12 "$work/$name.log"
    tar czf "$out/results.tgz" -C "$work" .
}

GPU_TEST_FILES="tests/test_kernels.py tests/test_gluon_history.py tests/test_static.py tests/test_step_replay.py tests/test_layer_bits.py
    tests/test_reliability.py tests/test_bench_gpu.py tests/test_key_centering.py tests/test_key_feedback.py"

gpu_tests() {  # the GPU test files given (default: all), under a header line with the command, machine and date
    local command="python3 -m pytest -q -n 12 -p no:cacheprovider ${*:-$(echo $GPU_TEST_FILES)}"
    local versions
    versions=$(python3 -c 'import torch, triton, transformers as t; print(f"torch {torch.__version__}, triton {triton.__version__}, transformers {t.__version__}")')
    echo "$command  # $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $versions, $(date -u +%F)"
    $command
}
merge() {  # merge NAME PART...: runs of one benchmark (one a batch, width or shape) as one result named NAME
    local name=$1
    shift
    [ $# -gt 0 ] && python3 -m eval.bench_gpu --merge "$@" --name "$name" --out "$work" >"$work/merge_$name.log" 2>&1
    tar czf "$out/results.tgz" -C "$work" .
}

merge_e2e() {  # the e2e-32k and e2e-100k steps' runs (one a batch) as one bench_e2e result
    merge bench_e2e $(ls "$work"/bench_e2e_32k_b*.json "$work"/bench_e2e_100k_b*.json 2>/dev/null)
}

merge_graph() {  # the graph steps' runs (8B, 4B, 8B at 64K) as one bench_graph result
    local parts=()
    for part in 8b 4b 8b_64k; do [ -f "$work/bench_graph_$part.json" ] && parts+=("$work/bench_graph_$part.json"); done
    merge bench_graph "${parts[@]}"
}

export -f gpu_tests
export GPU_TEST_FILES

for step in "$@"; do
    case $step in
        tests) run gpu_tests 560 bash -c gpu_tests ;;
        decoding-tests) run gpu_tests_decoding 480 bash -c 'gpu_tests tests/test_static.py tests/test_step_replay.py \
                            tests/test_reliability.py tests/test_layer_bits.py tests/test_key_centering.py' ;;
        tune) run tune 300 python3 kernels/tools/tune_decode.py --out "$work" ;;
        kernel) run kernel 120 $bench --config eval/configs/bench_kernel.json ;;
        threebit-tests) run threebit_tests 400 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_kernels.py \
            tests/test_gluon_history.py tests/test_static.py tests/test_quant.py \
            -k "int3 or k3v2 or 3bit or bit_exact or into_many or static_lengths or bit_widths or matches_reference" ;;
        kernel-bits)  # decode attention at 100K, batches 1 and 8, by widths (K/V bits) at head_dim 128 (the Gluon
            # span) and 64 (the Triton loop): one run each, merged into kernel_widths; then the Triton loop at
            # head_dim 128 by widths (kernel_widths_triton_loop)
            one="--config eval/configs/bench_kernel.json --set contexts=[100000] --set batches=[1,8] --set methods=[\"oscar_triton\"]"
            for d in 128 64; do
                for widths in 2/2 4/2 2/1 4/1 3/2 3/1; do
                    k=${widths%/*} v=${widths#*/}
                    run kernel_k${k}v${v}_d$d 120 $bench $one --set "shape={\"q_heads\":32,\"kv_heads\":8,\"head_dim\":$d}" \
                        --set k_bits=$k --set v_bits=$v --name kernel_k${k}v${v}_d$d
                done
            done
            merge kernel_widths $(ls "$work"/kernel_k*v*_d*.json)
            [ "${KERNEL_BITS:-all}" = widths ] && continue  # KERNEL_BITS=widths: kernel_widths only
            for widths in 2/2 4/2 2/1 4/1 3/2 3/1; do
                k=${widths%/*} v=${widths#*/}
                run kernel_k${k}v${v}_triton 120 env OSCAR_DECODE_HISTORY=triton $bench $one --set k_bits=$k --set v_bits=$v \
                    --name kernel_k${k}v${v}_triton
            done
            merge kernel_widths_triton_loop $(ls "$work"/kernel_k*v*_triton.json) ;;
        decode-graphs) run gpu_test_decode_graphs 300 python3 -m pytest -q -p no:cacheprovider tests/test_static.py -k gpu ;;
        step-times)  # every step of one generate call (freezing and capturing included), batches 1 and 8, uniform
            # 2-bit layers and the bundled recipe's mixed widths; STEP_BATCHES picks batches (default "1 8")
            run step_times 580 python3 -m eval.step_times --batch ${STEP_BATCHES:-1 8} \
                --caches dynamic oscar-int2 oscar-int2+mixed-widths --out "$work/step_times" ;;
        gluon-tests) run gpu_tests_gluon 300 bash -c 'gpu_tests tests/test_gluon_history.py tests/test_key_centering.py' ;;
        e2e | e2e-4b)
            model=qwen3-8b name=bench_e2e_8b
            [ "$step" = e2e-4b ] && model=qwen3-4b name=bench_e2e_4b
            run "$step" 420 $bench --config eval/configs/bench_e2e.json --name $name --set "models=[\"$model\"]" \
                --set decode.repeats=2 --set decode.new_tokens=16 ;;
        e2e-100k)  # the 8B at 100K: DynamicCache, compiled StaticCache (about 2 min to compile) and OscarCache; one
            # run a batch (E2E_BATCHES, default "1 8": compiled StaticCache's 512-token calls at batch 8 alone take
            # minutes: at batch 8 only OscarCache times whole calls); the batch-1 run adds OscarCache's short
            # generations (an lm-eval task) and the prefill
            for batch in ${E2E_BATCHES:-1 8}; do
                extra=(--set 'short_generations.caches=["oscar-int2"]')
                [ "$batch" = 1 ] || extra=(--set 'short_generations.caches=[]' --set 'prefill.caches=[]'
                    --set 'decode.call_caches=["oscar-int2"]')
                run "e2e_100k_b$batch" 560 $bench --config eval/configs/bench_e2e.json --name "bench_e2e_100k_b$batch" \
                    --set 'models=["qwen3-8b"]' --set 'contexts=[100000]' --set "batches=[$batch]" \
                    --set 'caches=["dynamic","static","oscar-int2"]' --set decode.repeats=1 "${extra[@]}"
            done
            merge_e2e ;;
        e2e-32k)  # the 8B at 32K, the same caches, one round, no short generations; one run a batch; at batch 8
            # only OscarCache times whole calls (compiled StaticCache's 512-token calls there take minutes)
            for batch in ${E2E_BATCHES:-1 8}; do
                calls=()
                [ "$batch" = 1 ] || calls=(--set 'decode.call_caches=["oscar-int2"]')
                run "e2e_32k_b$batch" 400 $bench --config eval/configs/bench_e2e.json --name "bench_e2e_32k_b$batch" \
                    --set 'models=["qwen3-8b"]' --set 'contexts=[32768]' --set "batches=[$batch]" \
                    --set 'caches=["dynamic","static","oscar-int2"]' --set decode.repeats=1 \
                    --set 'short_generations.caches=[]' --set 'prefill.caches=[]' ${calls[@]+"${calls[@]}"}
            done
            merge_e2e ;;
        static-tests) run gpu_test_static 170 python3 -m pytest -q -n 8 -p no:cacheprovider tests/test_static.py \
                          tests/test_kernels.py -k "static or window or compiled" ;;
        graph) run graph 480 $bench --config eval/configs/bench_graph.json --name bench_graph_8b \
                   --set 'models=["qwen3-8b"]' --set 'contexts=[32768,100000]'
            merge_graph ;;
        graph-4b | graph-8b-64k)  # fewer variants: eager, captured, and the best captured one
            caches='caches=["dynamic","oscar-int2","oscar-int2+graph","oscar-int2+absorbed+graph+compile+fused"]'
            if [ "$step" = graph-4b ]; then
                run "$step" 290 $bench --config eval/configs/bench_graph.json --name bench_graph_4b \
                    --set 'models=["qwen3-4b"]' --set "$caches"
            else
                run "$step" 120 $bench --config eval/configs/bench_graph.json --name bench_graph_8b_64k \
                    --set 'models=["qwen3-8b"]' --set 'contexts=[65536]' --set "$caches" \
                    --set 'compiled_static.models=[]' --set 'profile.model="none"'
            fi
            merge_graph ;;
        graph-gemms)  # the best captured 8B step at 100K, its GEMMs autotuned by Inductor or not
            run graph_gemms 420 $bench --config eval/configs/bench_graph.json --name bench_graph_gemms \
                --set 'models=["qwen3-8b"]' --set 'contexts=[100000]' --set 'compiled_static.models=[]' \
                --set 'caches=["oscar-int2+absorbed+graph+compile+fused","oscar-int2+absorbed+graph+autotune+fused"]' \
                --set 'profile.model="none"' ;;
        memory) run memory 200 $bench --config eval/configs/bench_memory.json --set max_batch.max_attempts=3 \
                    --set max_batch.probe_up=false ;;
        timeline) run timeline 300 python3 kernels/tools/timeline_decode.py --out "$work" --batches 1,8 --tiles 1,2,3,4,5,6,7,8 ;;
        timeline-32k)  # batch 1 at 32K: the span's programs and the three kernels' ends (the span is half a wave there)
            run timeline_32k 200 python3 kernels/tools/timeline_decode.py --out "$work/timeline_32k" --batches 1 --tiles 2 \
                --context 32768 ;;
        merge)  # the merge's warps and tile (floats a program), whole call
            run merge 300 python3 kernels/tools/time_gluon_history.py --out "$work" --batches 1,8 --dense-split-tokens 32 --pdl 1 \
                --settled 1 --merge-tiles 2048,4096,8192,16384 --merge-warps 1,2,4,8 ;;
        floors)  # the whole call with the dense tiers empty and the merge trivial (timing only)
            run floors 200 python3 kernels/tools/time_gluon_history.py --out "$work" --batches 1,8 --floors ;;
        multigpu) run multigpu 200 $bench --config eval/configs/bench_multigpu.json ;;
        multigpu-tests)  # two GPUs: device_map="auto", and tp_plan="auto" under torchrun
            run gpu_test_multigpu 400 python3 -m pytest -q -p no:cacheprovider tests/test_bench_gpu.py -k two_gpus ;;
        profile) run profile 120 python3 -m eval.profile_decode --out "$work" ;;
        gluon)  # the explicit-layout history span, tested and timed against the Triton stage 1
            run gluon_tests 200 python3 -m pytest -q -p no:cacheprovider tests/test_gluon_history.py
            run gluon_diagnosis 120 python3 kernels/tools/diagnose_gluon_history.py --out "$work"
            run gluon_timing 200 python3 kernels/tools/time_gluon_history.py --out "$work" ;;
        alternating-rows)  # K's and V's code rows side by side in one buffer against two buffers
            run alternating_rows 300 python3 kernels/tools/time_gluon_history.py --out "$work" --batches 1,8 --alternating-rows \
                --settled 1 --pdl 1 --dense-split-tokens 32 ;;
        halves)  # two halves of 32 keys a tile against one of 64
            run halves 300 python3 kernels/tools/time_gluon_history.py --out "$work" --batches 1,8 --halves 1,0 \
                --dense-split-tokens 32 --pdl 1 --settled 1 ;;
        kernel-b1)  # batch 1: the span alone in 1-3 waves, and the whole call
            run kernel_b1 200 python3 kernels/tools/time_gluon_history.py --out "$work" --batches 1 --programs-per-sm 16,32,48 \
                --dense-split-tokens 32 ;;
        registers)  # the span's register cap (programs an SM follow): its SASS, then batches 1 and 8 timed
            run registers_sass 200 bash -c 'for r in 128 120 112 104 96; do echo "== maxnreg $r"
                python3 kernels/tools/sass_count.py --span --registers $r; done'
            run registers 420 python3 kernels/tools/time_gluon_history.py --out "$work" --batches 1,8 --registers 128,120,112,104,96 \
                --dense-split-tokens 32 --pdl 1 ;;
        ncu)  # the history span's occupancy and stall reasons, direct and staged, batches 1 and 8
            # NCU_VARIANTS picks direct and/or staged; NCU_TAG suffixes the logs (to keep several runs apart)
            for batch in 1 8; do
                for variant in ${NCU_VARIANTS:-direct staged}; do
                    flag=""
                    [ "$variant" = staged ] && flag=--staged
                    run "ncu_span_b${batch}_$variant${NCU_TAG:+_$NCU_TAG}" 150 ncu --kernel-name regex:history_kernel \
                        --launch-skip 2 --launch-count 1 --section SpeedOfLight --section Occupancy --section LaunchStats \
                        --section SchedulerStats --section WarpStateStats --section MemoryWorkloadAnalysis \
                        --section MemoryWorkloadAnalysis_Tables --print-details all \
                        python3 kernels/tools/ncu_decode.py --batch "$batch" $flag
                done
            done ;;
        ncu-call)  # batch 1: the whole call's three kernels (span, dense tiers, merge) one by one, at base clocks
            run ncu_call_b1 150 ncu --kernel-name "regex:history_kernel|_decode_stage" --launch-skip 3 --launch-count 3 \
                --section SpeedOfLight --section LaunchStats --section Occupancy --print-details all \
                python3 kernels/tools/ncu_decode.py --batch 1 ;;
        calibration-cost)  # oscar_hf.calibrate's stages on the 8B shape: the default and the full recipe
            run calibration_cost 580 python3 -m eval.calibration_cost --out "$work/calibration_cost" ;;
        quality)  # the recipes' memory, held-out KL/PPL at 2K and 8K and teacher-forced needles (eval/ablate.py)
            run quality 580 python3 -m eval.ablate --config eval/configs/quality.json --device cuda --out "$work/quality" -v ;;
        levers)  # the recipes' levers at the same budget, held-out KL only (eval/ablate.py)
            run levers 580 python3 -m eval.ablate --config eval/configs/levers.json --device cuda --out "$work/levers" -v ;;
        *) echo "unknown step $step" >&2 ;;
    esac
done
