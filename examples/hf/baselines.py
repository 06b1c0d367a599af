"""Baselines of the federated LoRA example: the base alone, central LoRA, local-only LoRA.

Everything is shoal's own trainer (``LocalTrainer`` with the config's ``[train]`` settings and
the task's optimizer) on the data of the federated run's config, so only where the data sit
differs:

- **base**: the pre-trained model, adapters at their start (LoRA's B = 0: the base itself);
- **central LoRA**: one adapter trained on every client's training text pooled in one place,
  ``rounds x epochs`` passes (one optimizer throughout);
- **local-only LoRA**: each client trains its own adapter on its own text only, from the base,
  for ``rounds x epochs`` passes, and never shares it.

Evaluated on the held-out roles (the central test set) and on each client's own held-out
speeches (pooled per token over the clients: what ``fed_perplexity`` reports for the federated
model). With ``--federated DIR`` the federated run's last record is printed beside them.

    python examples/hf/baselines.py -c examples/hf/shakespeare_lora.toml --out runs/hf/baselines \\
        --federated runs/hf/fed
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
from pathlib import Path

from torch.utils.data import ConcatDataset

from shoal.assembly import initial_model, make_trainer, task_from_config
from shoal.client.training import LocalTrainer
from shoal.config import load_config
from shoal.seeding import derive_seed
from shoal.simulations.client_data import load_simulation_data


def per_token(means: list[dict[str, float]]) -> float:
    """Perplexity per token of several raw evaluations (``summarize=False``) pooled."""
    nll = sum(m["nll_sum"] * m["num_examples"] for m in means)
    tokens = sum(m["tokens"] * m["num_examples"] for m in means)
    return math.exp(nll / tokens)


def evaluate(trainer: LocalTrainer, params, test, client_tests) -> dict[str, float]:
    own = [trainer.evaluate_data(params, t, summarize=False) for t in client_tests if t is not None]
    return {
        "heldout_perplexity": trainer.evaluate_data(params, test)["perplexity"],
        "own_test_perplexity": per_token(own),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", type=Path, required=True, help="the federated run's TOML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value, as shoal's")
    parser.add_argument("--out", type=Path, default=Path("runs/hf/baselines"))
    parser.add_argument("--federated", type=Path, default=None, help="a federated run's output folder")
    parser.add_argument("--skip-local", action="store_true", help="no local-only runs (the slowest)")
    args = parser.parse_args()

    cfg = load_config(args.config, args.overrides)
    task = task_from_config(cfg)
    data = load_simulation_data(task, cfg)
    passes = cfg.simulation.rounds * cfg.train.epochs
    seed = cfg.simulation.seed
    trainer = make_trainer(cfg, task, initial_model(cfg, task), "cpu")
    start = trainer.flat.detach().clone()
    rows: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    rows["base"] = evaluate(trainer, start, data.test, data.client_test)
    print("base", json.dumps(rows["base"]), flush=True)

    central_cfg = copy.deepcopy(cfg)
    central_cfg.train.epochs = passes
    central = make_trainer(central_cfg, task, initial_model(cfg, task), "cpu")
    pooled = ConcatDataset(list(data.train))
    update = central.fit(start, pooled, derive_seed(seed, 0xCE))
    rows["central LoRA"] = evaluate(central, start + update.delta, data.test, data.client_test)
    rows["central LoRA"]["train_s"] = round(time.perf_counter() - t0, 1)
    print("central LoRA", json.dumps(rows["central LoRA"]), flush=True)

    if not args.skip_local:
        t1 = time.perf_counter()
        held, own = [], []
        for i, (train, test) in enumerate(zip(data.train, data.client_test or [None] * len(data.train))):
            delta = central.fit(start, train, derive_seed(seed, i, 0x10C)).delta
            held.append(central.evaluate_data(start + delta, data.test, summarize=False))
            if test is not None:
                own.append(central.evaluate_data(start + delta, test, summarize=False))
        # every client's own adapter on the held-out roles (mean loss over clients), and on its own test text
        mean_loss = sum(m["nll_sum"] / m["tokens"] for m in held) / len(held)
        rows["local-only LoRA"] = {
            "heldout_perplexity": math.exp(mean_loss),
            "own_test_perplexity": per_token(own),
            "train_s": round(time.perf_counter() - t1, 1),
        }
        print("local-only LoRA", json.dumps(rows["local-only LoRA"]), flush=True)

    if args.federated:
        records = [json.loads(line) for line in (args.federated / "metrics.jsonl").read_text().splitlines()]
        last = records[-1]
        rows["federated LoRA"] = {
            "heldout_perplexity": last["test_perplexity"],
            "own_test_perplexity": last.get("fed_perplexity", math.nan),
            "bytes_up_per_update": last["bytes_up"] / last["num_results"],
        }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "baselines.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("\n| model | held-out roles perplexity | clients' own test perplexity |")
    print("|---|---:|---:|")
    for name, r in rows.items():
        print(f"| {name} | {r['heldout_perplexity']:.3f} | {r['own_test_perplexity']:.3f} |")


if __name__ == "__main__":
    main()
