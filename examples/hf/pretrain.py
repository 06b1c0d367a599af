"""Pre-train the small GPT-2 base of the federated LoRA example, centrally, and save it locally.

The pre-training part of the play is every role that is neither a client nor held out
(``shakespeare_lora.split_play``): the base never sees the clients' or the held-out roles'
text. The model is a ``GPT2LMHeadModel`` built from a config (``shakespeare_lora.gpt2_config``)
and trained with AdamW on blocks of ``seq_len`` characters; the folder ``--out`` then holds
``config.json`` and ``model.safetensors`` (``save_pretrained``), which the task loads with
``from_pretrained(..., local_files_only=True)`` on every node.

    python examples/hf/pretrain.py --out runs/hf/base [--steps 400 --n-embd 64 --n-layer 2]
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
from shakespeare_lora import blocks, find_corpus, gpt2_config, split_play  # this script's folder

from shoal.hf import build_base
from shoal.task import DictDataset


@torch.no_grad()
def perplexity(model: torch.nn.Module, data: DictDataset, batch: int = 64) -> float:
    """exp(mean loss per predicted token) over ``data`` (padding excluded)."""
    model.eval()
    nll, tokens = 0.0, 0
    for s in range(0, len(data), batch):
        b = {k: v[s : s + batch] for k, v in data.tensors.items()}
        logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"]).logits[:, :-1].float()
        labels = b["labels"][:, 1:]
        nll += float(
            torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="sum")
        )
        tokens += int((labels != -100).sum())
    model.train()
    return math.exp(nll / max(tokens, 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/hf/base"))
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--n-embd", type=int, default=64)
    parser.add_argument("--n-layer", type=int, default=2)
    parser.add_argument("--n-head", type=int, default=4)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--heldout", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--path", default=None, help="the corpus (default: ../shared/datasets/tinyshakespeare)")
    args = parser.parse_args()

    fed, held, pre = split_play(find_corpus(args.path), args.clients, args.heldout)
    train = blocks("\n\n".join(pre), args.seq_len)
    held_out = blocks("\n\n".join(held), args.seq_len)
    clients = blocks("\n\n".join(s for _, speeches in fed for s in speeches), args.seq_len)
    print(
        f"pre-training text: {len(train)} blocks of {args.seq_len}; "
        f"held-out roles {len(held_out)}; clients {len(clients)}"
    )

    torch.manual_seed(args.seed)
    config = gpt2_config(args.n_embd, args.n_layer, args.n_head, args.seq_len)
    model = build_base(config, "causal-lm")
    print(f"GPT-2: {sum(p.numel() for p in model.parameters())} parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.steps, pct_start=0.1)
    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    model.train()
    for step in range(1, args.steps + 1):
        idx = torch.randint(len(train), (args.batch,), generator=gen)
        batch = {k: v[idx] for k, v in train.tensors.items()}
        loss = model(**batch).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 100 == 0 or step == args.steps:
            print(f"step {step}: train loss {loss.item():.3f} ({time.perf_counter() - t0:.0f} s)", flush=True)
    report = {
        "steps": args.steps,
        "parameters": sum(p.numel() for p in model.parameters()),
        "heldout_perplexity": perplexity(model, held_out),
        "clients_text_perplexity": perplexity(model, clients),
        "train_s": round(time.perf_counter() - t0, 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    (args.out / "pretrain.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report))


if __name__ == "__main__":
    main()
