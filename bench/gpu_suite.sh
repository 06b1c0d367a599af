#!/usr/bin/env bash
# Every GPU path of shoal measured in one run of a few minutes on one NVIDIA GPU.
#
#   bash bench/gpu_suite.sh --prepare   # here, with the package registry: fill .gpudata/ (ignored by git)
#   bash bench/gpu_suite.sh             # on the GPU machine, from the repository root
#   bash bench/gpu_suite.sh --only cuda_tests,dp_sgd   # some sections (names in the summary table)
#
# Every section at once takes 10-15 minutes; where one command may run at most 10, split it in two:
#   --only batched_fp32,batched_tf32,batched_bf16,batched_mm_tf32,batched_mm_bf16,niid_round
#   --only batched_layers,noise_device,dp_sgd,cuda_tests,ray_gpu,node_cuda
#
# --prepare copies MNIST from ../shared/datasets into .gpudata/mnist and downloads into
# .gpudata/whl the Python 3.12 wheels a CUDA image without shoal's dependencies lacks (opacus,
# dp-accounting, zstandard, cryptography, ray and what they need; ray without its Java jar and
# its RL/serving/data libraries, which shoal never imports, so the folder travels under 64 MiB).
# Carry .gpudata to the GPU machine with the checkout.
#
# The run installs the missing wheels and shoal (editable, no downloads), then, each section
# bounded in time and reported even when another fails:
#   1. batched simulation vs one-by-one training on the same GPU: MNIST CNN, 2NN and logistic
#      regression with 10, 100 and 1,000 clients per round (600 examples each, E = 1, B = 10),
#      seconds per round and FLOP/s against the GPU's data-sheet peak (bench/sim_throughput.py),
#      the batched steps as CUDA graph replays and eagerly side by side; the CNN at 1,000 clients
#      once more in TF32 and in bf16, and with its convolutions as batched matmuls (im2col + bmm,
#      simulation.batched_conv = "matmul") in TF32 and bf16; the GRU classifier (400 clients, 100 a
#      round), a transformer encoder and the CNN's two convolution paths batched vs one by one
#      (bench/batched_layers.py);
#   1b. NIID-Bench's setting (10 MNIST CNN clients, E = 10, B = 64; bench/niid_bench.py): seconds
#      per round of FedAvg with CUDA graphs and without, 4 rounds each (the first not counted);
#   2. DP-SGD (Opacus per-sample gradients) against plain SGD on the GPU (bench/bench_dp_sgd.py);
#   2b. the CSPRNG's Gaussian keystreams side by side for the CNN's 1.66M parameters (torch's
#      generator, AES-CTR on the CPU copied over, ChaCha20 made on the GPU; bench/ddg_noise.py) and
#      ChaCha20's variants, torch.compile included (bench/chacha20_variants.py);
#   3. the CUDA tests (and the training/aggregation test files around them) with pytest;
#   4. the Ray engine with two workers sharing the GPU (ray_gpus_per_worker = 0.5) against the
#      in-process engine on the same GPU (bench/engines.py);
#   5. `shoal server` + two `shoal client` nodes training on CUDA vs on the CPU (bench/gpu_node.py).
# Each section's output goes to $OUT (or /tmp/gpu_suite); the benches also print one `RESULT {json}`
# line per measured cell there, from which bench/gpu_summary.py ends the run with a table: per
# section its figures, the previous ones (bench/gpu_previous.json: value, card, date), new/previous
# and which direction is better, and the share of the card's data-sheet peak where a FLOP count is
# defined ("peak unknown" for a card not in bench/sim_throughput.py's table).
# On a machine without CUDA it says so and exits 0.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DATA=.gpudata

prepare() {
  local shared=../shared/datasets/mnist-reconstructed
  [[ -d $shared ]] || { echo "gpu_suite: $shared not found (../shared beside the checkout)"; exit 2; }
  grep -qx '/.gpudata/' .git/info/exclude 2>/dev/null || echo '/.gpudata/' >>.git/info/exclude
  mkdir -p "$DATA/mnist" "$DATA/whl"
  cp "$shared"/*.gz "$DATA/mnist/"
  local plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
  local p
  for p in opacus==1.6.0 dp-accounting==0.6.0 dm-tree==0.1.10 zstandard==0.25.0 cryptography==50.0.2 \
    cffi==2.1.1 pycparser==3.12 ray==2.55.1 jsonschema==4.26.0 referencing==0.37.0 \
    jsonschema-specifications==2025.9.1 rpds-py; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      "${plat[@]}" -d "$DATA/whl" "$p" || exit 2
  done
  "$PY" - "$DATA/whl" <<'EOF'
import sys, zipfile
from pathlib import Path
drop = ("ray/jars/", "ray/rllib/", "ray/serve/", "ray/data/", "ray/llm/", "ray/train/", "ray/tune/",
        "ray/dashboard/client/")
for whl in Path(sys.argv[1]).glob("ray-*.whl"):
    tmp = whl.with_suffix(".tmp")
    with zipfile.ZipFile(whl) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if info.filename.startswith(drop):
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                keep = [ln for ln in data.decode().splitlines() if not ln.startswith(drop)]
                data = ("\n".join(keep) + "\n").encode()
            dst.writestr(info, data)
    tmp.replace(whl)
EOF
  du -sh "$DATA" "$DATA"/*
  echo "gpu_suite: prepared $DATA (carry it with the checkout)"
}

ONLY=""
case ${1:-} in
  --prepare) prepare; exit 0 ;;
  --only) ONLY=",${2:?--only takes section names, comma-separated},"; ;;
  "") ;;
  *) echo "usage: bash bench/gpu_suite.sh [--prepare | --only SECTION,...]"; exit 2 ;;
esac

if ! "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  echo "gpu_suite: no CUDA device visible to $PY (torch.cuda.is_available() is False): nothing to measure"
  exit 0
fi

OUT=${OUT:-/tmp/gpu_suite}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLWR_TELEMETRY_ENABLED=0 FLWR_DISABLE_UPDATE_CHECK=1
start=$(date +%s)

# What the image lacks, from the prepared wheels; then shoal itself (editable, no index, no deps).
if [[ -d $DATA/whl ]]; then
  missing=()
  for whl in "$DATA"/whl/*.whl; do
    name=$(basename "$whl" | cut -d- -f1)
    "$PY" -m pip show -q "${name//_/-}" >/dev/null 2>&1 || missing+=("$whl")
  done
  if ((${#missing[@]})); then
    "$PY" -m pip install -q --no-index --no-deps --no-compile "${missing[@]}" >"$OUT/install.log" 2>&1 ||
      { echo "gpu_suite: installing the prepared wheels failed:"; tail -20 "$OUT/install.log"; exit 1; }
  fi
fi
"$PY" -c 'import shoal.aggregation' 2>/dev/null ||
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >>"$OUT/install.log" 2>&1 ||
  { echo "gpu_suite: installing shoal failed:"; tail -20 "$OUT/install.log"; exit 1; }

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader 2>/dev/null | sed 's/^/gpu: /'
"$PY" -c 'import torch; print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")'
CARD=$("$PY" -c 'import torch; print(torch.cuda.get_device_name(0))')
MNIST=$(realpath "$DATA/mnist" 2>/dev/null || echo "$DATA/mnist")

: >"$OUT/sections.tsv"
section() {  # section NAME LIMIT_S COMMAND...: run with a time limit, keep its output, note how it ended
  local name=$1 limit=$2
  shift 2
  [[ -z $ONLY || $ONLY == *",$name,"* ]] || return 0
  echo
  echo "=== $name (at most ${limit} s)"
  local t0=$SECONDS rc
  timeout --kill-after=10 "$limit" "$@" 2>&1 | tee "$OUT/$name.log" | grep -v -E 'Warning|warnings.warn|^RESULT |^\s*$'
  rc=${PIPESTATUS[0]}
  local status
  case $rc in
    0) status=ok ;;
    124 | 137) status="timed out" ;;
    *) status="failed ($rc)" ;;
  esac
  printf '%s\t%s\t%s\n' "$name" "$status" $((SECONDS - t0)) >>"$OUT/sections.tsv"
}

section batched_fp32 240 "$PY" bench/sim_throughput.py --device cuda --models cnn,2nn,logreg --ks 10,100,1000 \
  --samples 600 --repeats 2 --seq-cap 50 --cuda-graphs both
section batched_tf32 60 "$PY" bench/sim_throughput.py --device cuda --models cnn --ks 1000 --samples 600 \
  --precision tf32 --repeats 2 --seq-cap 20
section batched_bf16 60 "$PY" bench/sim_throughput.py --device cuda --models cnn --ks 1000 --samples 600 \
  --precision bf16 --repeats 2 --seq-cap 20
section batched_mm_tf32 60 "$PY" bench/sim_throughput.py --device cuda --models cnn --ks 1000 --samples 600 \
  --precision tf32 --batched-conv matmul --repeats 2 --seq-cap 20
section batched_mm_bf16 60 "$PY" bench/sim_throughput.py --device cuda --models cnn --ks 1000 --samples 600 \
  --precision bf16 --batched-conv matmul --repeats 2 --seq-cap 20
section batched_layers 240 "$PY" bench/batched_layers.py --device cuda --repeats 2
section niid_round 150 bash -c "'$PY' bench/niid_bench.py --data '$MNIST' --device cuda --rounds 4 \
  --splits dirichlet --algorithms fedavg --out '$OUT/niid_graphs' --round-time --cuda-graphs on &&
  '$PY' bench/niid_bench.py --data '$MNIST' --device cuda --rounds 4 --splits dirichlet --algorithms fedavg \
  --out '$OUT/niid_eager' --round-time --cuda-graphs off"
section dp_sgd 90 "$PY" bench/bench_dp_sgd.py --device cuda --model 2nn,cnn --n 1500 --repeats 2
section noise_device 150 bash -c "'$PY' bench/ddg_noise.py --device cuda --n 1663370 --reps 5 &&
  '$PY' bench/chacha20_variants.py --device cuda --blocks 831685 --reps 5 --compile"
section cuda_tests 120 "$PY" -m pytest -q -p no:cacheprovider -o addopts= -rs \
  tests/aggregation/test_mean.py tests/aggregation/test_strategy.py tests/client tests/privacy/test_chacha20.py \
  tests/privacy/test_randomness.py
section ray_gpu 120 "$PY" bench/engines.py --device cuda --engines inprocess,ray2gpu --clients 200 --cohort 100 \
  --rounds 3 --model cnn --data-dir "$MNIST" --ray-cpus 4
section node_cuda 120 "$PY" bench/gpu_node.py --data-dir "$MNIST" --rounds 3 --examples 3000

echo
echo "=== summary ($(($(date +%s) - start)) s in all; logs in $OUT; previous figures from bench/gpu_previous.json)"
"$PY" bench/gpu_summary.py --out "$OUT" --card "$CARD" || echo "gpu_suite: the summary failed (the logs are in $OUT)"
