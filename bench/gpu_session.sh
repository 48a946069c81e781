#!/usr/bin/env bash
# What a session lent a GPU machine runs there, one step per device call (each call has at
# most 10 minutes; a session has 15 minutes of device time in all, starts included, so the
# order is by value: tests, llama1b, llama7b, smollm2, then the rest in later sessions).
# The recipe is ../shared/gpu/README.md's: wheels for what the device lacks in .whl/
# (carried), random weights of real shapes built on the device. Results go to $OUT. The copy
# there has no .git: pass the commit, as in `LLMDB_COMMIT=<hash> bash bench/gpu_session.sh tests`.
#
#   bash bench/gpu_session.sh tests     # tests/gpu and the Triton kernels, compiled (the
#                                       # batch-invariant checks in bf16 too)
#   bash bench/gpu_session.sh smollm2   # nano-vllm's workload, launch-ahead on and off
#   bash bench/gpu_session.sh llama1b   # the 1B fixed row beside HF generate and the bare decoder
#   bash bench/gpu_session.sh llama7b   # the 7B row (200 x 128 in / 128 out)
#   bash bench/gpu_session.sh bulk      # a SQL-like job: 4,000 rows through 512 slots, so
#                                       # most steps are mixed: mixed graphs on vs off
#   bash bench/gpu_session.sh host      # the host's work per step on this machine's CPU
#   bash bench/gpu_session.sh invariant # batch_invariant=True against the default (cuBLAS,
#                                       # split-KV): its cost, to decide the GPU default
#   bash bench/gpu_session.sh hybrid-capacity       # issue 12: OPT-13B, an A100-40GB's cache
#   bash bench/gpu_session.sh hybrid-capacity-apt   #   (apt's modes of the same)
#   bash bench/gpu_session.sh hybrid-shared         # issue 12: prompts sharing a prefix
#   bash bench/gpu_session.sh hybrid-fcfs           # issue 12: SLO attainment vs rate, fcfs,
#   bash bench/gpu_session.sh hybrid-apt            # then apt (one call each: ~5 min apiece)
set -euo pipefail
step=${1:?"which step: tests, smollm2, llama1b, llama7b, bulk, host, invariant, hybrid-capacity, hybrid-capacity-apt, hybrid-shared, hybrid-fcfs or hybrid-apt"}
out=${OUT:-/tmp/llmdb-gpu-out}
mkdir -p "$out"

if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site \
        .whl/*.whl >/dev/null
    export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/gpu.txt" || true

throughput() {  # one JSON line per engine, appended to $out/throughput.jsonl
    python3 bench/throughput.py --device cuda "$@" | tee -a "$out/throughput.jsonl"
}

case $step in
tests)
    python3 -m pytest -q -rs tests/gpu tests/test_triton_kernels.py tests/test_batch_invariant.py \
        2>&1 | tail -25 \
        | tee "$out/tests.txt"
    ;;
smollm2)
    for ahead in on off; do
        throughput --shape smollm2-135m --workload nanovllm --launch-ahead "$ahead"
    done
    ;;
llama1b)
    fixed=(--shape llama3.2-1b --workload fixed --rows 400 --prompt-len 128 --max-tokens 128)
    throughput "${fixed[@]}" --peer transformers --bare
    throughput "${fixed[@]}" --launch-ahead off
    ;;
llama7b)
    fixed=(--shape llama2-7b --workload fixed --rows 200 --prompt-len 128 --max-tokens 128)
    throughput "${fixed[@]}" --bare
    # HF generate in batches of 100, as the reference row ran it.
    throughput "${fixed[@]}" --peer transformers --skip-llmdb --rows-at-once 100
    ;;
bulk)
    for mixed in on off; do
        throughput --shape smollm2-135m --workload bulk --mixed-graphs "$mixed"
        throughput --shape llama3.2-1b --workload bulk --mixed-graphs "$mixed"
    done
    throughput --shape smollm2-135m --workload bulk --launch-ahead off
    ;;
invariant)
    for invariant in "" --batch-invariant; do
        throughput --shape smollm2-135m --workload standard $invariant
        throughput --shape llama3.2-1b --workload fixed --rows 400 --prompt-len 128 \
            --max-tokens 128 $invariant
        throughput --shape smollm2-135m --workload nanovllm $invariant
    done
    ;;
host)
    python3 bench/host_overhead.py --stub-model --running 64 256 512 | tee -a "$out/host.jsonl"
    python3 bench/host_overhead.py --stub-model --launch-ahead --running 256 \
        | tee -a "$out/host.jsonl"
    ;;
hybrid-capacity | hybrid-capacity-apt)
    # Every mode loads the 13B engine again: the cache's own capacity (the target)
    # in one call, apt's modes in another.
    modes=(fcfs_kv fcfs_all_hidden)
    [ "$step" = hybrid-capacity-apt ] && modes=(apt_kv apt_hybrid apt_hybrid_memory_only)
    python3 bench/hybrid.py --device cuda --only capacity --shape opt-13b --cache-mb 12000 \
        --capacity-requests 256 --prompt 96 --output 96 --modes "${modes[@]}" \
        | tee -a "$out/hybrid.jsonl"
    ;;
hybrid-shared)
    # Rows of one SQL call: every prompt starts with the same 256 tokens, which hidden-cache
    # requests read from a KV request's blocks (apt with the engine's cost model, then
    # memory alone).
    python3 bench/hybrid.py --device cuda --only capacity --shape opt-13b --cache-mb 12000 \
        --capacity-requests 256 --shared-prefix 256 --prompt 64 --output 96 \
        --modes apt_kv apt_hybrid apt_hybrid_memory_only | tee -a "$out/hybrid.jsonl"
    ;;
hybrid-fcfs | hybrid-apt)
    python3 bench/hybrid.py --device cuda --only slo --slo-shape opt-13b --slo-cache-mb 12000 \
        --scale 1 --ttft 1 --tbt 1 --rates 1 2 3 4 6 --slo-requests 100 \
        --policies "${step#hybrid-}" | tee -a "$out/hybrid.jsonl"
    ;;
*)
    echo "unknown step $step" >&2
    exit 2
    ;;
esac
