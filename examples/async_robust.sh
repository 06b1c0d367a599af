#!/usr/bin/env bash
# The runs behind docs/results.md, "Robust rules in asynchronous FedBuff / FedAsync" (issue 10):
# MNIST logistic regression, 20 IID clients of which 20% attack, on the virtual clock.
#   examples/async_robust.sh PATH_TO_MNIST [OUT_DIR]
set -euo pipefail
MNIST=${1:?path to the MNIST idx files}
OUT=${2:-runs/async_robust}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
SHOAL=${SHOAL:-shoal}
ASYNC=(simulation.mode=async simulation.rounds=20 heterogeneity.speed_sigma=1.0 heterogeneity.network_delay_s=0.5
       asynchronous.buffer_size=10 asynchronous.concurrency=10)
run() {  # name, config, overrides...
  local name=$1 cfg=$2; shift 2
  local args=()
  for s in "${ASYNC[@]}" "$@"; do args+=(--set "$s"); done
  "$SHOAL" simulate -q -c "$cfg" "${args[@]}" -o "$OUT/$name"
}
A=examples/mnist_logreg_attack.toml
M=data.dir="$MNIST"
run fedbuff_clean_mean "$A" "$M"
run fedbuff_clean_median "$A" "$M" robust.rule=median
for rule in mean median trimmed_mean multikrum; do
  run "fedbuff_signflip10_$rule" "$A" "$M" attack.kind=sign_flip robust.rule=$rule robust.trim_beta=0.3 robust.krum_f=3
done
run fedbuff_signflip10_mean_normbound1 "$A" "$M" attack.kind=sign_flip robust.norm_bound=1.0
run fedbuff_nan_mean "$A" "$M" attack.kind=\"nan\"  # quoted: a bare nan is the TOML float
run fedasync_clean "$A" "$M" asynchronous.algorithm=fedasync
run fedasync_signflip10 "$A" "$M" asynchronous.algorithm=fedasync attack.kind=sign_flip
run fedasync_signflip10_normbound1 "$A" "$M" asynchronous.algorithm=fedasync attack.kind=sign_flip robust.norm_bound=1.0
# The coordinate median on non-IID data, no attack: Synthetic(1,1), 20 clients, 100 versions
for rule in mean median; do
  "$SHOAL" simulate -q --set "${ASYNC[0]}" --set simulation.rounds=100 --set simulation.num_clients=20 \
    --set asynchronous.buffer_size=10 --set asynchronous.concurrency=10 --set strategy.weighting=uniform \
    --set heterogeneity.speed_sigma=1.0 --set heterogeneity.network_delay_s=0.5 --set robust.rule=$rule \
    --set output.plots=false -o "$OUT/synthetic11_clean_$rule"
done
"${PYTHON:-python}" - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print("| run | final acc | lowest acc | versions | accepted | rejected | MB up | MB down |")
print("|---|---|---|---|---|---|---|---|")
for d in sorted(p for p in Path(sys.argv[1]).iterdir() if (p / "summary.json").exists()):
    s = json.loads((d / "summary.json").read_text())
    accs = [json.loads(x)["test_accuracy"] for x in (d / "metrics.jsonl").read_text().splitlines()][1:]
    print(f"| {d.name} | {s['final_test_accuracy']:.4f} | {min(accs):.4f} | {s['version']} | {s['updates_accepted']} "
          f"| {s['updates_rejected'] or '-'} | {s['bytes_up_total'] / 1e6:.1f} | {s['bytes_down_total'] / 1e6:.1f} |")
PY
