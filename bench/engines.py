"""Seconds per round and peak memory of one experiment on each engine: in-process, Ray with
1 and 2 workers, and Flower's (Ray) simulation.

The same config and seed on every engine: by default MNIST (../shared/datasets), McMahan's
CNN (1.66M parameters), 100 IID clients, a cohort of 20 per round, E=1, B=10, evaluated
after the last round only (so a round's time is its clients' training and aggregation).
Each engine runs in its own child process, so each driver's peak RSS is its own; worker
processes (Ray actors) are found under the child's process tree (/proc) and their peak
RSS (VmHWM) read while they run. The driver's torch uses one thread, as each 1-CPU worker
does, so in-process vs Ray compares the same per-client work; Ray's two workers use two
cores. Prints setup and round-loop seconds, seconds per round, the ratio to in-process,
the final accuracy (the engines should agree) and the peak memory of driver and workers.

    .venv/bin/python bench/engines.py [--clients 100] [--cohort 20] [--rounds 3]
        [--engines inprocess,ray1,ray2,flower] [--mode sync|async|gossip] [--dataset mnist|synthetic] [--model cnn]
    .venv/bin/python bench/engines.py --device cuda --engines inprocess,ray2gpu   # a GPU shared by two workers

``--mode gossip``: ``--algorithm`` (gossip.algorithm: push-pull "gossip", "dpsgd",
"group_average", "secure_groups") among ``--clients`` peers, all of which train every round
(``--cohort`` is not used; Flower has no gossip), accuracy of the peers' average model.
Push-pull trains each peer at its own wake time (what it trains on depends on what it merged
before), so it sends one peer per call; the others train a round's peers in one call.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("FLWR_DISABLE_UPDATE_CHECK", "1")

REPO = Path(__file__).resolve().parents[1]
# ../shared/datasets beside the checkout (or beside the folder of worktrees)
MNIST = (
    next(
        (p for p in (REPO.parent / "shared", REPO.parent.parent / "shared") if (p / "datasets").is_dir()),
        REPO.parent / "shared",
    )
    / "datasets"
    / "mnist-reconstructed"
)
ENGINES = {
    "inprocess": ["simulation.engine='inprocess'"],
    # ray_share_gpu: measure the Ray workers even where shoal would run in-process instead (docs/ray.md, "One GPU")
    "ray1": ["simulation.engine='ray'", "simulation.ray_workers=1", "simulation.ray_share_gpu=true"],
    "ray2": ["simulation.engine='ray'", "simulation.ray_workers=2", "simulation.ray_share_gpu=true"],
    # two workers sharing one GPU (run with --device cuda)
    "ray2gpu": [
        "simulation.engine='ray'",
        "simulation.ray_workers=2",
        "simulation.ray_gpus_per_worker=0.5",
        "simulation.ray_share_gpu=true",
    ],
    "flower": ["simulation.engine='flower'", "simulation.flower_client_cpus=1"],
}


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (Ray's GCS, raylet and worker processes started by ray.init)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def proc_info(pid: int) -> tuple[str, float] | None:
    """(command line, peak RSS in MiB) of a live process, or None."""
    try:
        cmd = (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        for line in (Path("/proc") / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return cmd, int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


# Ray's own processes on a node (not workers that train): left out of the workers' figures
RAY_SERVICES = {"ray::IDLE", "ray::DashboardAgent", "ray::RuntimeEnvAgent"}


class WorkerMemory:
    """Polls the peak RSS of this process's Ray actor processes (``ray::<ActorClass>``) while it runs."""

    def __init__(self, period_s: float = 0.2):
        self.peaks: dict[int, float] = {}
        self.names: dict[int, str] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(period_s,), daemon=True)
        self._thread.start()

    def _run(self, period_s: float) -> None:
        me = os.getpid()
        while not self._stop.wait(period_s):
            try:
                for pid in descendants(me):
                    info = proc_info(pid)
                    if info and info[0].startswith("ray::") and info[0].split()[0] not in RAY_SERVICES:
                        self.names[pid] = info[0].split()[0]
                        self.peaks[pid] = max(self.peaks.get(pid, 0.0), info[1])
            except Exception as e:  # noqa: BLE001 - a process vanishing mid-read must not end the sampling
                print(f"memory sampling: {e!r}", file=sys.stderr)

    def stop(self) -> dict[int, float]:
        self._stop.set()
        self._thread.join()
        return self.peaks


def child(engine: str, overrides: list[str]) -> None:
    """Run one engine; print one JSON line of figures."""
    import resource

    import torch

    from shoal.config import load_config
    from shoal.simulations.experiment import run_simulation

    torch.set_num_threads(1)
    cfg = load_config(None, overrides + ENGINES[engine])
    memory = WorkerMemory()
    with tempfile.TemporaryDirectory() as out:
        t0 = time.perf_counter()
        summary = run_simulation(cfg, out, progress=False)
        total = time.perf_counter() - t0
    peaks = memory.stop()
    print(
        json.dumps(
            {
                "engine": engine,
                "total_s": total,
                "rounds_s": summary["wall_s"],
                "rounds": summary["rounds"],
                "accuracy": summary.get("final_test_accuracy", summary.get("final_average_model_accuracy")),
                "driver_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                "worker_peaks_mb": sorted(peaks.values(), reverse=True),
                "worker_names": sorted(set(memory.names.values())),
                "worker_peaks_reported_mb": summary.get("ray_worker_peak_rss_mb"),
            }
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--cohort", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--engines", default="inprocess,ray1,ray2,flower")
    ap.add_argument(
        "--mode",
        default="sync",
        choices=["sync", "async", "gossip"],
        help="async: FedBuff with concurrency = cohort and buffer = cohort / 2 on the virtual clock (not on Flower); "
        "gossip: push-pull among all clients, every peer trains each round (not on Flower)",
    )
    ap.add_argument("--algorithm", default="gossip", help="gossip.algorithm for --mode gossip")
    ap.add_argument("--dataset", default="mnist", choices=["mnist", "synthetic"])
    ap.add_argument("--model", default="cnn")
    ap.add_argument("--data-dir", default=str(MNIST), help="the MNIST folder (idx .gz files)")
    ap.add_argument("--device", default="cpu", help="simulation.device: cpu | cuda (ray2gpu: 0.5 GPU per worker)")
    ap.add_argument("--ray-cpus", type=int, default=os.cpu_count() or 1, help="CPUs the local Ray runtime may use")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--overrides", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, json.loads(args.overrides))
        return
    overrides = [
        f"simulation.num_clients={args.clients}",
        f"simulation.clients_per_round={args.cohort}",
        f"simulation.rounds={args.rounds}",
        f"simulation.eval_every={args.rounds}",
        "simulation.batch_clients='auto'",
        f"simulation.device='{args.device}'",
        "simulation.progress=false",
        "output.plots=false",
        f"simulation.ray_num_cpus={args.ray_cpus}",
        "train.batch_size=10",
        "train.epochs=1",
    ]
    if args.mode == "async":
        overrides += [
            "simulation.mode='async'",
            f"asynchronous.concurrency={args.cohort}",
            f"asynchronous.buffer_size={max(1, args.cohort // 2)}",
            "heterogeneity.speed_sigma=0.5",
        ]
    if args.mode == "gossip":
        overrides += ["simulation.mode='gossip'", "gossip.eval_peers=4", f"gossip.algorithm='{args.algorithm}'"]
    if args.dataset == "mnist":
        overrides += [
            "data.dataset='mnist'",
            f"data.dir='{args.data_dir}'",
            "data.partition='iid'",
            f"model.name='{args.model}'",
        ]
    else:
        overrides += ["model.name='logreg'"]
    results = []
    for engine in args.engines.split(","):
        cmd = [sys.executable, __file__, "--child", engine, "--overrides", json.dumps(overrides)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        lines = [ln for ln in done.stdout.splitlines() if ln.startswith("{")]
        if done.returncode or not lines:
            print(f"{engine}: failed (exit {done.returncode})\n{done.stderr[-3000:]}", file=sys.stderr)
            continue
        results.append(json.loads(lines[-1]))
    desc = f"{args.dataset} / {args.model if args.dataset == 'mnist' else 'logreg'}"
    what = {
        "sync": f"{args.cohort} per round",
        "async": f"FedBuff, {args.cohort} training at once",
        "gossip": f"gossip.algorithm = {args.algorithm}, every peer trains each round",
    }[args.mode]
    print(
        f"{desc}: {args.clients} clients, {what}, {args.rounds} server steps; {os.cpu_count()} CPU(s), "
        f"device {args.device}"
    )
    print(
        f"{'engine':<10} {'total s':>8} {'rounds s':>9} {'s/round':>8} {'x inproc':>9} {'final acc':>9} "
        f"{'driver MiB':>10} {'workers MiB (peak each)':>24}"
    )
    base = next((r for r in results if r["engine"] == "inprocess"), None)
    for r in results:
        per_round = r["rounds_s"] / max(r["rounds"], 1)
        ratio = per_round / (base["rounds_s"] / max(base["rounds"], 1)) if base else float("nan")
        peaks = r["worker_peaks_reported_mb"] or r["worker_peaks_mb"]  # a Ray worker's own figure when it has one
        workers = ",".join(f"{m:.0f}" for m in peaks) or "-"
        print(
            f"{r['engine']:<10} {r['total_s']:>8.1f} {r['rounds_s']:>9.1f} {per_round:>8.2f} {ratio:>9.2f} "
            f"{r['accuracy']:>9.4f} {r['driver_peak_mb']:>10.0f} {workers:>24}"
        )
        line = {"bench": "engines", "engine": r["engine"], "device": args.device, "s_per_round": per_round}
        print(
            "RESULT " + json.dumps(line | {"x_inprocess": ratio if base else None, "accuracy": r["accuracy"]})
        )  # bench/gpu_summary.py


if __name__ == "__main__":
    main()
