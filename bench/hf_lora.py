"""LoRA fine-tuning through shoal.hf on CPU and on CUDA, side by side: one client's local
training (dict batches through the DataLoader, ``to_device``, the model's own loss, AdamW on
the adapters) on the same data from the same start; prints seconds per local training, the
ratio, and how far the CUDA update is from the CPU one (and the bf16 one from fp32).

    python bench/hf_lora.py [--n-embd 64 --n-layer 2 --blocks 512 --reps 3]

The text is synthetic (token ids from a fixed generator), so the run needs no data set.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from shoal.client.training import LocalTrainer
from shoal.config import TrainConfig
from shoal.hf import HFTask
from shoal.task import DictDataset, make_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--blocks", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    config = {
        "model_type": "gpt2",
        "vocab_size": 98,
        "n_positions": args.seq_len,
        "n_embd": args.n_embd,
        "n_layer": args.n_layer,
        "n_head": 4,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
    }
    lora = {"r": 8, "lora_alpha": 16, "target_modules": ["c_attn", "c_proj", "c_fc"], "lora_dropout": 0.0}
    task = HFTask(config, peft=lora)
    task.optimizer = "adamw"
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 98, (args.blocks, args.seq_len), generator=g)
    data = DictDataset(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
    cfg = TrainConfig(epochs=1, batch_size=32, lr=0.01)
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    out: dict[str, dict[str, float]] = {}
    deltas = {}
    for device in devices:
        for precision in ("fp32", "bf16") if device == "cuda" else ("fp32",):
            c = TrainConfig(**{**cfg.__dict__, "precision": precision})
            trainer = LocalTrainer(make_model(task, seed=1), c, device=device, task=task)
            start = trainer.flat.detach().clone()
            times = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                update = trainer.fit(start, data, seed=0)
                if device == "cuda":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            ev = trainer.evaluate_data(start + update.delta, data, batch_size=256)
            key = f"{device}-{precision}"
            deltas[key] = update.delta.detach().cpu()
            out[key] = {
                "s_per_local_training": min(times),
                "loss_after": ev["loss"],
                "steps": update.metrics["local_steps"],
            }
            print(key, json.dumps(out[key]), flush=True)
    print(f"adapter parameters: {deltas['cpu-fp32'].numel()}")
    for key in deltas:
        if key != "cpu-fp32":
            diff = (deltas[key] - deltas["cpu-fp32"]).norm() / deltas["cpu-fp32"].norm()
            ratio = out["cpu-fp32"]["s_per_local_training"] / out[key]["s_per_local_training"]
            print(
                f"{key}: {ratio:.2f}x the CPU's speed; update differs from the CPU's by {float(diff):.2e} (relative norm)"
            )


if __name__ == "__main__":
    main()
