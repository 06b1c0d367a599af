"""Whether one overflowing example changes what a local-DP node sends, over many rounds.

    python bench/overflow_notice.py --runs 200

Two nodes built from the same config (logreg, 40 examples, DP-SGD at z = 1, C = 1, fixed-step
sampling at q = 0.25): one whose first example overflows (its logits, loss and gradient are not
finite), one without it. Each run trains one round on both and compares what each would send: the
upload's header and framing byte for byte (only the noised tensor may differ), and whether it
would send a notice instead. Also counts how often the old check on the un-noised update (a node
judging divergence from its own train loss) would have sent a `diverged` notice. The CI test
(tests/privacy/test_overflow_notice.py) runs 20 rounds of the same."""

from __future__ import annotations

import argparse
import time

import torch

from shoal.client.node import Node
from shoal.config import config_from_dict
from shoal.privacy_state import diverged
from shoal.rounds import Assignment
from shoal.shards import Shard
from shoal.wire import update_parts


def node(x: torch.Tensor, y: torch.Tensor) -> Node:
    cfg = config_from_dict(
        {
            "model": {"name": "logreg"},
            "train": {"batch_size": 10, "lr": 0.05},
            "privacy": {"mode": "local", "noise_multiplier": 1.0, "clip_norm": 1.0, "local_sampling_rate": 0.25},
        }
    ).validate()
    return Node.from_config("https://127.0.0.1:1", "t", Shard("n0", x, y, 10), cfg, torch.device("cpu"), None)


def sent(n: Node, round_: int) -> tuple[bytes, str | None, bool]:
    """(header and framing of the upload, the notice sent instead or None, the old check's verdict)."""
    task = {"round": round_, "version": round_ - 1, "seed": 7, "privacy": {"mode": "local"}}
    params = torch.randn(n.trainer.spec.numel, generator=torch.Generator().manual_seed(round_))
    update = n.program.fit(n.train, Assignment("n0", round_, round_ - 1, 7), params, {}, {}).update
    old = diverged(update) is not None
    assert n.privacy is not None
    out, report, problem = n.privacy.release(update, task)
    parts = update_parts(out, n.trainer.spec, {"round": round_, **({"privacy": report} if report else {})})
    frame = b"".join(bytes(p) for p in parts[:-1]) if len(parts) > 1 else bytes(parts[0])[:64]
    return frame, problem, old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=200)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 60, generator=gen), torch.randint(0, 10, (40,), generator=gen)
    bad_x = x.clone()
    bad_x[0] = 1e38
    clean, overflow = node(x, y), node(bad_x, y)
    same = notices_clean = notices_overflow = old_clean = old_overflow = 0
    t0 = time.perf_counter()
    for r in range(1, args.runs + 1):
        a, pa, oa = sent(clean, r)
        b, pb, ob = sent(overflow, r)
        same += a == b
        notices_clean += pa is not None
        notices_overflow += pb is not None
        old_clean += oa
        old_overflow += ob
    assert clean.privacy is not None and overflow.privacy is not None
    print(
        f"{args.runs} runs ({time.perf_counter() - t0:.1f} s): header and framing identical in {same}; "
        f"notices sent {notices_clean} (clean) / {notices_overflow} (one overflowing example); rounds spent "
        f"{clean.privacy.rounds} / {overflow.privacy.rounds}; the old un-noised check would have sent "
        f"{old_clean} / {old_overflow}"
    )


if __name__ == "__main__":
    main()
