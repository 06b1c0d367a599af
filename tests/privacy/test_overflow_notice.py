"""Under local DP a node's messages do not depend on one example whose loss overflows.

Its divergence was judged from the un-noised train loss, and it sent a `diverged` notice before
spending the round: one example then told the server it was there. Now the node judges only the
update DP-SGD released (and an example whose gradient is non-finite adds 0), spends first, and a
notice carries no reason. The node's own parts (assembly.build through Node.from_config) train
and release each update; the upload body is compared byte for byte apart from the noised tensor."""

from __future__ import annotations

import math

import torch

from shoal.client.node import Node
from shoal.config import config_from_dict
from shoal.privacy_state import diverged
from shoal.rounds import Assignment
from shoal.shards import Shard
from shoal.wire import update_parts

RUNS = 20  # bench-size runs are for the docs figure; here enough to see a difference of 142 in 200


def _cfg():
    return config_from_dict(
        {
            "model": {"name": "logreg"},
            "train": {"batch_size": 10, "lr": 0.05},
            "privacy": {"mode": "local", "noise_multiplier": 1.0, "clip_norm": 1.0, "local_sampling_rate": 0.25},
        }
    ).validate()


def _node(x: torch.Tensor, y: torch.Tensor) -> Node:
    return Node.from_config("https://127.0.0.1:1", "t", Shard("n0", x, y, 10), _cfg(), torch.device("cpu"), None)


def messages(node: Node, round_: int, version: int) -> tuple[bytes, str | None, bool]:
    """What the node sends for one task: the upload body apart from the noised tensor (header and
    framing), the notice it would send instead (None: it uploads), and whether the old check on the
    un-noised update would have sent a `diverged` notice."""
    task = {"round": round_, "version": version, "seed": 7, "privacy": {"mode": "local"}}
    params = torch.randn(node.trainer.spec.numel, generator=torch.Generator().manual_seed(version))  # the model
    result = node.program.fit(node.train, Assignment("n0", round_, version, 7), params, {}, {})
    update = result.update
    old_notice = diverged(update) is not None
    assert node.privacy is not None
    sent, report, problem = node.privacy.release(update, task)
    extra = {"round": round_, **({"privacy": report} if report is not None else {})}
    parts = update_parts(sent, node.trainer.spec, extra)
    frame = b"".join(bytes(p) for p in parts[:-1]) if len(parts) > 1 else bytes(parts[0])[:64]
    return frame, problem, old_notice


def test_one_overflowing_example_changes_no_message_but_the_noised_update():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(40, 60, generator=gen)
    y = torch.randint(0, 10, (40,), generator=gen)
    bad_x = x.clone()
    bad_x[0] = 1e38  # its logits overflow: its loss is not finite, nor its gradient
    clean, overflow = _node(x, y), _node(bad_x, y)
    old_notices = 0
    for r in range(1, RUNS + 1):
        a, problem_a, _ = messages(clean, r, r - 1)
        b, problem_b, old = messages(overflow, r, r - 1)
        old_notices += old
        assert a == b, r  # header and framing byte for byte
        assert problem_a is None and problem_b is None  # no notice, whatever the data
    assert clean.privacy is not None and overflow.privacy is not None
    assert clean.privacy.rounds == overflow.privacy.rounds == RUNS  # spent alike
    # the old check on the un-noised loss would have sent a notice for the overflowing data
    assert old_notices > 0


def test_a_noised_update_that_is_not_finite_is_noticed_without_a_reason():
    from shoal.update import Update

    node = _node(torch.randn(20, 60), torch.randint(0, 10, (20,)))
    assert node.privacy is not None
    bad = Update(torch.full((node.trainer.spec.numel,), math.nan), 1, 0, "n0", {"train_loss": 1.0})
    sent, _, problem = node.privacy.release(bad, {"round": 1, "version": 0, "privacy": {"mode": "local"}})
    assert problem is not None and "NaN" in problem and sent.metrics == {}
    assert node.privacy.rounds == 1  # spent before the notice
