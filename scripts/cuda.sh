#!/usr/bin/env bash
# The CUDA backend's GPU checks, for a machine without a GPU (build) and one with a GPU
# but no Rust toolchain (run), such as the lent device machine:
#
#   scripts/cuda.sh build    # here: release test binary + CLI with --features cuda -> .gpu/
#   scripts/cuda.sh run      # there (repository root, .gpu/ carried): tests, then the bench
#
# `run` writes its logs under $OUT (or ./cuda-out) and prints the bench table last.
# Without a GPU every GPU test skips with a message; with libnvrtc on LD_LIBRARY_PATH the
# kernels are still compiled (nvrtc_compiles_the_kernels_for_each_dtype).
set -euo pipefail
cd "$(dirname "$0")/.."

case "${1:-}" in
build)
    target="${CARGO_TARGET_DIR:-target}"
    exe=$(cargo test --release --features cuda --test cuda --no-run --message-format=json 2>/dev/null |
        python3 -c 'import json,sys
for l in sys.stdin:
    m=json.loads(l)
    if m.get("reason")=="compiler-artifact" and m["target"]["name"]=="cuda" and m.get("executable"): print(m["executable"])')
    cargo build --release --features cuda -p fusedbn-cli
    mkdir -p .gpu
    cp "$exe" .gpu/cuda-tests
    cp "$target/release/fusedbn" .gpu/fusedbn
    strip .gpu/cuda-tests .gpu/fusedbn
    ls -la .gpu
    ;;
run)
    out="${OUT:-cuda-out}"
    mkdir -p "$out"
    export LD_LIBRARY_PATH=/usr/local/cuda/lib64:/usr/local/cuda-13.0/targets/x86_64-linux/lib:${LD_LIBRARY_PATH:-}
    set -o pipefail
    nvidia-smi -L 2>&1 | tee "$out/info.log" || true
    echo "== tests (every op x layout x dtype x mode, odd sizes, large M, empty, determinism, fixtures)"
    FUSEDBN_FIXTURES_ROOT="$PWD" .gpu/cuda-tests --test-threads 4 --nocapture 2>&1 | tee "$out/tests.log" | tail -40
    echo "== bench (GPU.md's shapes and 2x8x8x32; every op checked against the reference first)"
    .gpu/fusedbn bench --device cuda --runs "${RUNS:-15}" ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log"
    ;;
*)
    echo "usage: scripts/cuda.sh build|run" >&2
    exit 2
    ;;
esac
