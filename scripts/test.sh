#!/usr/bin/env bash
# The test command (README's, and what .ci/run runs): every test of the workspace, the
# synchronized batch norm under mpirun among them (cargo feature `mpi`, OpenMPI).
#
#   scripts/test.sh          install OpenMPI if missing (apt-get, as root), then test
#   scripts/test.sh --deps   only install what is missing
#
# Without root or apt-get, a missing OpenMPI is an error that says what to install;
# FUSEDBN_SKIP_MPI=1 runs only the default build's tests (no MPI needed).
set -euo pipefail
cd "$(dirname "$0")/.."

# OpenMPI and what the `mpi` crate's bindgen needs at build time (see MPI.md in the
# project notes: libclang-common for stddef.h; MPICH works but is far slower here).
MPI_PACKAGES=(libopenmpi-dev openmpi-bin libclang1-14 libclang-common-14-dev)

mpi_missing() {
    local missing=()
    for p in "${MPI_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
    done
    echo "${missing[@]:-}"
}

install_mpi() {
    if command -v dpkg-query >/dev/null 2>&1; then
        local missing
        missing="$(mpi_missing)"
        [ -z "$missing" ] && return 0
        if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
            echo "== installing $missing"
            apt-get update -qq
            # shellcheck disable=SC2086
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $missing >/dev/null
            return 0
        fi
        echo "scripts/test.sh: missing packages: $missing (install them, or set FUSEDBN_SKIP_MPI=1)" >&2
        return 1
    fi
    if ! command -v mpirun >/dev/null 2>&1 || ! command -v mpicc >/dev/null 2>&1; then
        echo "scripts/test.sh: OpenMPI (mpirun, mpicc) and libclang are needed for the MPI tests (or set FUSEDBN_SKIP_MPI=1)" >&2
        return 1
    fi
}

if [ "${FUSEDBN_SKIP_MPI:-0}" != 1 ]; then
    install_mpi
fi
[ "${1:-}" = --deps ] && exit 0

# One optimized build of the workspace, with the `mpi` feature unless MPI is skipped:
# every release test (the candle and burn training examples' #[test]s, the MPI tests
# under mpirun -n 2, 3 and 4, and `fusedbn run --sync mpi` under mpirun -n 3) in one
# cargo invocation, so the library is compiled once, with one feature set. (A second
# invocation with other features compiled it again: 9m10 of a 2-core run.)
features=()
if [ "${FUSEDBN_SKIP_MPI:-0}" != 1 ]; then
    # mpirun as root, more ranks than cores, loopback only.
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader OMPI_MCA_oob_tcp_if_include=lo
    features=(--features fusedbn/mpi,fusedbn-cli/mpi)
fi
echo "== cargo test --workspace --release ${features[*]}"
cargo test --workspace --release "${features[@]}"

# The library's unit tests, unoptimized, as a user's debug build compiles it: overflow
# checks and debug assertions on, and kernels whose frames take megabytes of stack (see
# `on_enough_stack` in src/kernels/simd/mod.rs). Only here: `test = false` keeps them
# out of the optimized run above (Cargo.toml says why). About 1.5 minutes.
echo "== cargo test -p fusedbn --lib (unoptimized)"
cargo test -p fusedbn --lib

if [ "${FUSEDBN_SKIP_MPI:-0}" = 1 ]; then
    echo "== MPI tests skipped (FUSEDBN_SKIP_MPI=1)"
else
    # The default build (no `mpi` feature) refuses `--sync mpi` with a clear error:
    # checked in the unoptimized build, which compiles the library without MPI (build
    # and run: 1m40).
    echo "== fusedbn run --sync mpi without the mpi feature (unoptimized)"
    cargo test -p fusedbn-cli --test sync
fi
