#!/usr/bin/env bash
# FEMNIST (105 writers = 105 peers), logistic regression, the same local work per round for
# every algorithm (E = 1, B = 20, lr = 0.01): FedAvg vs push-pull gossip vs D-PSGD vs group
# averaging vs secure groups, accuracy per round and per byte (docs/results.md, gossip section).
#   examples/femnist_gossip_compare.sh PATH_TO_FEMNIST_LEAF [OUT_DIR]
# then: python examples/femnist_gossip_report.py OUT_DIR
set -euo pipefail
D=${1:?path to the FEMNIST-LEAF data}
O=${2:-runs/femnist_compare}
export OMP_NUM_THREADS=1
S="shoal simulate -q -c examples/femnist_gossip.toml --set data.dir=$D --set simulation.eval_every=10"
$S --set simulation.mode='"sync"' --set simulation.rounds=60 -o "$O/fedavg"
$S --set simulation.rounds=90 --set gossip.algorithm='"group_average"' -o "$O/group_average"
$S --set simulation.rounds=90 --set gossip.algorithm='"group_average"' --set gossip.group_levels=1 -o "$O/group_average_1axis"
$S --set simulation.rounds=90 --set gossip.exchanges_per_round=5 -o "$O/pushpull5"
$S --set simulation.rounds=90 --set gossip.algorithm='"dpsgd"' --set gossip.topology='"regular"' \
   --set gossip.degree=4 --set gossip.exchanges_per_round=10 -o "$O/dpsgd10"
$S --set simulation.rounds=90 --set gossip.algorithm='"secure_groups"' --set gossip.group_size=4 -o "$O/secure_groups"
