#!/usr/bin/env bash
# Interleaved A/B of two or more fusedbn binaries (built from different commits), the
# way every speed comparison in docs/performance.md and CHANGELOG.md was measured on
# a noisy machine: ROUNDS rounds, each running `BIN bench ARGS --json` for every
# binary in turn, then the median over rounds of each case's time ÷ copy and of its ms.
#
#   git worktree add /tmp/before <commit> && (cd /tmp/before && cargo build --release -p fusedbn-cli)
#   cargo build --release -p fusedbn-cli
#   scripts/ab.sh 3 "--format NCHW --shape 128,7,7,2048 --dtype f32,bf16" \
#       /tmp/before/target/release/fusedbn target/release/fusedbn
#
# Binaries with the same file name are told apart by their position (#1, #2, ...).
set -euo pipefail
if [ "$#" -lt 3 ]; then
    echo "usage: scripts/ab.sh ROUNDS \"BENCH ARGS\" BIN_A BIN_B [BIN ...]" >&2
    exit 2
fi
rounds=$1
args=$2
shift 2
for b in "$@"; do
    [ -x "$b" ] || { echo "scripts/ab.sh: $b is not an executable" >&2; exit 2; }
done
out=$(mktemp)
trap 'rm -f "$out"' EXIT
for r in $(seq "$rounds"); do
    i=0
    for b in "$@"; do
        i=$((i + 1))
        # shellcheck disable=SC2086 # ARGS is a list of flags
        "$b" bench $args --json | sed "s|^|$i |" >>"$out"
    done
    echo "scripts/ab.sh: round $r of $rounds done" >&2
done
python3 - "$out" "$@" <<'PY'
import collections, json, statistics, sys

ratio = collections.defaultdict(list)
ms = collections.defaultdict(list)
for line in open(sys.argv[1]):
    b, rec = line.split(" ", 1)
    d = json.loads(rec)
    shape = d["shape"]
    shape = "x".join(map(str, shape)) if isinstance(shape, list) else str(shape)
    if d.get("offset"):
        shape += "+%d" % d["offset"]
    key = (d["op"], d["format"], d["dtype"], d.get("isa", ""), shape)
    ratio[key, b].append(d["copy_ratio"])
    ms[key, b].append(d["median_ms"])
bins = [f"#{i} {p}" for i, p in enumerate(sys.argv[2:], 1)]
print("case", *bins, sep="\t")
for key in sorted({k for k, _ in ratio}):
    cells = [
        "%.3f (%.4g ms)" % (statistics.median(ratio[key, str(i)]), statistics.median(ms[key, str(i)]))
        for i in range(1, len(bins) + 1)
    ]
    print(" ".join(key), *cells, sep="\t")
PY
