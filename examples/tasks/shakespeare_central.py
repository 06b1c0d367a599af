"""The centrally trained baseline of the Shakespeare example: what federation costs.

The same task, model, initialisation, loss and local trainer (shoal's LocalTrainer with the
config's [train] settings) as ``shoal simulate``, but on every role's training text pooled
in one place. Each "round" processes as many examples as a federated round: the selected
clients' share of the pooled data (all of it when every client trains every round), for
``train.epochs`` passes. As on a client, the optimizer's momentum starts afresh each round.
The evaluation is the simulation's central test set (every role's held-out speeches).

    python examples/tasks/shakespeare_central.py -c examples/tasks/shakespeare.toml --out runs/shakespeare_central
    python examples/tasks/shakespeare_central.py -c examples/tasks/shakespeare.toml --out runs/shakespeare_central \\
        --federated runs/shakespeare          # also print a table beside the federated run's metrics.jsonl

It also prints the most-frequent-character baseline: the accuracy of always predicting the
character that is most frequent in the training text.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from shoal.assembly import expected_clients, initial_model, make_trainer, task_from_config
from shoal.config import load_config
from shoal.seeding import derive_seed
from shoal.simulations.client_data import load_simulation_data
from shoal.task import as_tensors


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("-c", "--config", type=Path, required=True, help="the federated run's TOML")
    parser.add_argument("--set", dest="overrides", action="append", default=[], help="section.key=value, as shoal's")
    parser.add_argument("--out", type=Path, default=Path("runs/shakespeare_central"))
    parser.add_argument("--federated", type=Path, default=None, help="a federated run's output folder to compare")
    args = parser.parse_args()

    cfg = load_config(args.config, args.overrides)
    task = task_from_config(cfg)
    data = load_simulation_data(task, cfg)
    pairs = [as_tensors(d) for d in data.train]
    x, y = torch.cat([p[0] for p in pairs]), torch.cat([p[1] for p in pairs])
    test = data.test
    if test is None:
        raise SystemExit("error: the task gives no central test set")

    counts = torch.bincount(y.flatten())
    top = int(counts.argmax())
    freq_acc = float((test[1] == top).float().mean())
    print(f"pooled training data: {len(y)} sequences from {len(pairs)} clients; test: {len(test[1])} sequences")
    print(f"most-frequent-character baseline (id {top}): test accuracy {freq_acc:.4f}")

    model = initial_model(cfg, task)
    trainer = make_trainer(cfg, task, model, "cpu")
    params = trainer.flat.detach().clone()
    n_clients = len(pairs)
    per_round = round(len(y) * expected_clients(cfg, n_clients) / n_clients)  # a federated round's examples
    args.out.mkdir(parents=True, exist_ok=True)
    records = []
    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(cfg.simulation.seed)
    for r in range(1, cfg.simulation.rounds + 1):
        idx = torch.randperm(len(y), generator=gen)[:per_round]
        trainer.fit(params, (x[idx], y[idx]), derive_seed(cfg.simulation.seed, r, 0xCE))
        params = trainer.flat.detach().clone()
        ev = trainer.evaluate_data(params, test)
        rec = {
            "round": r,
            **{f"test_{k}": v for k, v in ev.items() if k != "num_examples"},
            "examples": per_round * cfg.train.epochs,
            "elapsed_s": round(time.perf_counter() - t0, 2),
        }
        records.append(rec)
        print(json.dumps(rec), flush=True)
    (args.out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (args.out / "summary.json").write_text(
        json.dumps(
            {
                "most_frequent_char_accuracy": freq_acc,
                "train_sequences": len(y),
                "test_sequences": len(test[1]),
                "final": records[-1],
                "wall_s": round(time.perf_counter() - t0, 2),
            },
            indent=2,
        )
        + "\n"
    )
    if args.federated:
        print_table(args.federated / "metrics.jsonl", records)


def print_table(fed_path: Path, central: list[dict]) -> None:
    """Markdown: per round, test accuracy and perplexity of the federated and the central model."""
    fed = {r["round"]: r for r in map(json.loads, fed_path.read_text().splitlines())}
    print("\n| round | federated accuracy | central accuracy | federated perplexity | central perplexity |")
    print("|---:|---:|---:|---:|---:|")
    for c in central:
        f = fed.get(c["round"], {})
        fa, fp = f.get("test_accuracy"), f.get("test_perplexity")
        print(
            f"| {c['round']} | {'' if fa is None else f'{fa:.4f}'} | {c['test_accuracy']:.4f} | "
            f"{'' if fp is None else f'{fp:.2f}'} | {c['test_perplexity']:.2f} |"
        )


if __name__ == "__main__":
    main()
