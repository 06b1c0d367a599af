#!/usr/bin/env bash
# The runs behind docs/results.md, "Robust aggregation and compression" (issue 10).
#   examples/robust_and_compression.sh PATH_TO_MNIST [OUT_DIR]
set -euo pipefail
MNIST=${1:?path to the MNIST idx files}
OUT=${2:-runs/issue10}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
SHOAL=${SHOAL:-shoal}
run() {  # name, config, overrides...
  local name=$1 cfg=$2; shift 2
  local args=()
  for s in "$@"; do args+=(--set "$s"); done
  "$SHOAL" simulate -q -c "$cfg" --set data.dir="$MNIST" "${args[@]}" -o "$OUT/$name"
}
A=examples/mnist_logreg_attack.toml
run clean_mean "$A"
for rule in median trimmed_mean krum multikrum; do run "clean_$rule" "$A" robust.rule=$rule; done
for rule in mean median trimmed_mean krum multikrum; do
  run "signflip10_$rule" "$A" attack.kind=sign_flip attack.scale=10.0 robust.rule=$rule
  run "scale100_$rule" "$A" attack.kind=scale attack.scale=100.0 robust.rule=$rule
done
run signflip1_mean "$A" attack.kind=sign_flip attack.scale=1.0
for rule in mean median; do
  run "labelflip_$rule" "$A" attack.kind=label_flip robust.rule=$rule
  run "gaussian_$rule" "$A" attack.kind=gaussian attack.scale=1.0 robust.rule=$rule
done
run signflip10_mean_normbound1 "$A" attack.kind=sign_flip attack.scale=10.0 robust.norm_bound=1.0
run scale100_mean_normbound1 "$A" attack.kind=scale attack.scale=100.0 robust.norm_bound=1.0
run nan_mean "$A" attack.kind=\"nan\"  # quoted: a bare nan is the TOML float
C=examples/mnist_2nn_compression.toml
run c_dense "$C"
run c_q8 "$C" compression.encoding=\"q8\"
run c_topk04 "$C" compression.encoding=\"topk\" compression.topk_fraction=0.04
run c_topk04_zstd "$C" compression.encoding=\"topk\" compression.topk_fraction=0.04 compression.zstd=true
.venv/bin/python examples/robust_and_compression_report.py "$OUT" docs/img
