#!/usr/bin/env bash
# Installs the peers that scripts/bench_peers.py measures into one Python (default:
# python3 on PATH; PYTHON=.venv-tf/bin/python for a venv): TensorFlow (CPU) and numpy
# from scripts/requirements-peers.txt, and PyTorch for the CPU.
#
# PyPI's Linux x86_64 torch wheel is a CUDA build whose dependencies are ~3 GB of
# nvidia-* / cuda-toolkit wheels (and triton), and no CPU-only index is reachable here.
# So: the torch wheel from PyPI with --no-deps, its pure-Python requirements by hand, and
# stub CUDA libraries (scripts/torch_cuda_stubs.py: empty libcudart.so.13, libcublas.so.13,
# ... with the sonames, version nodes and symbols torch links against) in
# $FUSEDBN_PEERS_CACHE/stubs, which must be on LD_LIBRARY_PATH before the process starts.
# bench_peers.py does that itself for its torch worker; for anything else, export what this
# script prints at the end. torch.cuda.is_available() is then False; CPU tensors work.
#
# Idempotent: re-running reinstalls nothing that is already at the pinned version and
# rebuilds the stubs (cheap). Needs pip access to PyPI, cc and readelf (gcc, binutils:
# installed with apt-get when missing and run as root). Takes a few minutes the first time
# (torch is a ~540 MB download, tensorflow-cpu ~250 MB).
#
#   bash scripts/install_peers.sh
#   PYTHON=.venv-tf/bin/python TORCH_VERSION=2.15.0 bash scripts/install_peers.sh
set -euo pipefail

PYTHON=${PYTHON:-python3}
TORCH_VERSION=${TORCH_VERSION:-2.15.0}
CACHE=${FUSEDBN_PEERS_CACHE:-$HOME/.cache/fusedbn-peers}
STUBS=$CACHE/stubs
HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

say() { echo "install_peers: $*" >&2; }
pip() { "$PYTHON" -m pip install --disable-pip-version-check "$@"; }

if ! command -v cc >/dev/null || ! command -v readelf >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        say "installing gcc and binutils (for the stub libraries)"
        apt-get update -qq && apt-get install -y -qq gcc binutils >/dev/null
    else
        say "need cc and readelf (apt-get install gcc binutils)"; exit 1
    fi
fi

say "TensorFlow and numpy ($HERE/requirements-peers.txt) into $("$PYTHON" -c 'import sys; print(sys.prefix)')"
pip -r "$HERE/requirements-peers.txt"

# torch without its CUDA dependencies. (pip check, and pip's resolver with an "ERROR: ...
# dependency conflicts" line, will list them as missing: expected, harmless.)
have=$("$PYTHON" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
if [ "${have%%+*}" != "$TORCH_VERSION" ]; then
    say "torch $TORCH_VERSION from PyPI, --no-deps (was: ${have:-none})"
    pip --no-deps "torch==$TORCH_VERSION"
else
    say "torch $have already installed"
fi
# Its pure-Python requirements (Requires-Dist of the wheel, less the CUDA ones and triton).
pip filelock "typing-extensions>=4.13.0" "setuptools>=77.0.3" "sympy>=1.13.3" "networkx>=2.5.1" \
    jinja2 "fsspec>=0.8.5"

say "stub CUDA libraries in $STUBS"
"$PYTHON" "$HERE/torch_cuda_stubs.py" --python "$PYTHON" --out "$STUBS" >/dev/null

# Check: both import (from a neutral directory: the repository's scripts/ is no package).
cd /
LD_LIBRARY_PATH="$STUBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" "$PYTHON" - <<'EOF'
import numpy, torch
x = torch.randn(2, 3, 4, 4).contiguous(memory_format=torch.channels_last)
y = torch.batch_norm(x, None, None, None, None, True, 0.1, 1e-5, False)
assert y.shape == x.shape and not torch.cuda.is_available()
print(f"install_peers: torch {torch.__version__} imports (cuda available: {torch.cuda.is_available()}), numpy {numpy.__version__}")
EOF
TF_CPP_MIN_LOG_LEVEL=2 "$PYTHON" -c 'import tensorflow as tf; print(f"install_peers: tensorflow {tf.__version__} imports")'

echo
echo "# To import torch outside bench_peers.py, first:"
echo "export LD_LIBRARY_PATH=$STUBS\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}"
