#!/usr/bin/env bash
# The GPU runs of docs/benchmarks.md, made ready for a machine with CUDA, torch, triton and
# transformers but no network (as the project's lent H100/H200 machines are).
#
#   benchmarks/gpu.sh wheels       here, with network: the wheels such a machine lacks, in .whl/
#   benchmarks/gpu.sh STAGE...     there, from the repo root, with .whl/ beside it:
#       tests     nvidia-smi, the GPU tests (pytest -m gpu: kernels and compiled decode vs
#                 transformers), the per-kernel benchmark
#       llama3    zoo bench, Llama-3.2-1B shape, compiled, vs transformers (static cache + compile)
#       llama3-8b zoo bench, Llama-3.1-8B shape, compiled (llama3-8b-vs: vs transformers too)
#       deepseek  zoo bench, DeepSeek-V2-Lite shape (MLA + MoE), compiled
#
# Each stage writes STAGE.log (and its JSON report) to $OUT, or ./gpu-out where OUT is unset.
set -euo pipefail
cd "$(dirname "$0")/.."

# What `zoo bench` and the GPU tests need that such an image lacks (serving is not run there).
NEEDED=(pydantic pydantic-core annotated-types typing-inspection typing-extensions gguf)
PY=${PYTHON:-python3}
OUT=${OUT:-gpu-out}
COMMON=(--random-weights --device cuda --dtype bfloat16 --compile
        --prompt-lens 128,512,2048 --batches 1,4,16 --decode-tokens 64 --repeat 5)

wheels() {  # resolve for the device's Python (3.12), keep only the packages it lacks
    local all
    all=$(mktemp -d)
    "$PY" -m pip download -q --only-binary=:all: --python-version "${PYVER:-3.12}" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 --platform any -d "$all" \
        pydantic gguf
    rm -rf .whl && mkdir .whl  # one version of each: two would stop the install there
    for name in "${NEEDED[@]}"; do
        cp "$all/${name//-/_}"-[0-9]*.whl .whl/
    done
    rm -rf "$all"
    local exclude
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >>"$exclude"
    ls -1 .whl
}

setup() {  # carried wheels into /tmp/site; the repo itself from its folder (no install)
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/site .whl/*.whl
    else
        echo "no wheels in .whl/: fine where ${NEEDED[*]} are installed" >&2
    fi
    export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
    mkdir -p "$OUT"
}

bench() {  # bench NAME JSON [options]: zoo bench of a registry shape
    local name=$1 json=$2
    shift 2
    "$PY" -m core.cli bench --shape "$name" "${COMMON[@]}" --json "$OUT/$json" "$@"
}

stage() {
    case $1 in
    tests)
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        "$PY" -c 'import torch, triton, transformers; print("torch", torch.__version__,
            "triton", triton.__version__, "transformers", transformers.__version__)'
        local rc=0
        "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/kernels || rc=$?
        "$PY" benchmarks/kernels.py || rc=1  # the figures, even where a test failed
        return $rc ;;
    llama3) bench llama3 llama3-1b.json --compare transformers --hf-compile ;;
    llama3-8b) bench llama3-8b llama3-8b.json ;;
    llama3-8b-vs) bench llama3-8b llama3-8b-vs.json --compare transformers --hf-compile ;;
    deepseek) bench deepseek dsv2-lite.json ;;
    *) echo "unknown stage $1 (see the top of $0)" >&2; return 2 ;;
    esac
}

if [[ ${1:-} == wheels ]]; then
    wheels
    exit
fi
[[ $# -gt 0 ]] || { sed -n '2,13p' "$0"; exit 2; }
setup
failed=()
for s in "$@"; do
    echo "== $s  $(date -u +%FT%TZ)  $(git rev-parse --short HEAD 2>/dev/null || true)"
    stage "$s" 2>&1 | tee "$OUT/$s.log" || failed+=("$s")
done
[[ ${#failed[@]} -eq 0 ]] || { echo "== failed: ${failed[*]}"; exit 1; }
