"""Empirical membership-inference audit: the loss-threshold attack of Yeom et al. 2018
("Privacy Risk in Machine Learning: Analyzing the Connection to Overfitting", CSF).

The attacker sees a sample's loss under the final global model and guesses "member" when
it is low. Sweeping the threshold gives a ROC curve over members (training samples of
clients that took part) against non-members (held-out samples the model never saw):
AUC 0.5 means the losses tell the two apart no better than a coin; the true-positive
rate at 1% false positives is the number Carlini et al. 2022 argue matters. An audit
gives a lower bound on leakage, never a guarantee; epsilon is the guarantee.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from shoal.client.training import LocalTrainer
from shoal.task import ClientData, Task, as_tensors, call_part, num_examples, split_batch


@torch.no_grad()
def per_sample_loss(
    trainer: LocalTrainer, params: torch.Tensor, data: ClientData, indices: np.ndarray, batch_size: int = 2048
) -> np.ndarray:
    """The task's loss of each selected sample under ``params`` (leaves the trainer's buffer changed).

    With the default loss (cross-entropy) one batched pass; with the task's own loss, which
    returns a batch mean, one call per sample (a batch of one), so any loss the task
    defines is the attacker's score."""
    trainer.flat.copy_(params.to(trainer.device))
    trainer.model.eval()
    task, device = trainer.task, trainer.device
    pair = as_tensors(data)
    if pair is not None and type(task).loss is Task.loss:
        x, y = pair
        idx = torch.as_tensor(indices, dtype=torch.long)
        out = []
        for i in range(0, len(idx), batch_size):
            j = idx[i : i + batch_size]
            xb, yb = task.to_device((x[j.to(x.device)], y[j.to(y.device)]), device)
            out.append(F.cross_entropy(trainer.model(xb).float(), yb, reduction="none").double().cpu())
        return torch.cat(out).numpy() if out else np.zeros(0)
    losses = []
    for i in indices:
        xb, yb = split_batch(task.to_device(one_sample(task, data, int(i)), device))
        losses.append(float(call_part(task, "loss(model, x, y)", task.loss, trainer.model, xb, yb)))
    return np.asarray(losses, dtype=np.float64)


def one_sample(task: Task, data: ClientData, i: int):
    """Sample ``i`` of ``data`` as a batch of one (an (x, y) pair or a dict with 'labels')."""
    pair = as_tensors(data)
    if pair is not None:
        return pair[0][i : i + 1], pair[1][i : i + 1]
    collate = task.collate_fn or torch.utils.data.default_collate
    batch = collate([data[i]])
    return batch if isinstance(batch, dict) else tuple(batch)


def roc_auc(member: np.ndarray, nonmember: np.ndarray) -> float:
    """P(score_member > score_nonmember) + P(tie) / 2 (the Mann-Whitney form of the AUC)."""
    non = np.sort(nonmember)
    below = np.searchsorted(non, member, side="left")
    ties = np.searchsorted(non, member, side="right") - below
    return float(np.mean(below + 0.5 * ties) / len(non))


def tpr_at_fpr(member: np.ndarray, nonmember: np.ndarray, fpr: float = 0.01) -> float:
    """The largest true-positive rate of a threshold whose false-positive rate is <= ``fpr``."""
    non = np.sort(nonmember)[::-1]
    k = int(np.floor(fpr * len(non)))  # at most k non-members may score above the threshold
    threshold = non[k] if k < len(non) else -np.inf
    return float(np.mean(member > threshold))


def loss_threshold_audit(
    trainer: LocalTrainer,
    params: torch.Tensor,
    members: Sequence[ClientData],
    nonmembers: Sequence[ClientData],
    samples: int,
    seed: int,
) -> dict[str, float]:
    """AUC and TPR at 1% FPR of the loss attack on equal-sized random draws of each pool.

    A pool is a list of datasets (the participants' training data; the held-out data)."""
    gen = np.random.default_rng(seed)
    sizes = [[num_examples(d) for d in pool] for pool in (members, nonmembers)]
    m = min(samples, sum(sizes[0]), sum(sizes[1]))
    scores = []
    for pool, sz in zip((members, nonmembers), sizes):
        picks = np.sort(gen.choice(sum(sz), size=m, replace=False))
        bounds = np.cumsum([0, *sz])
        losses = []
        for k, d in enumerate(pool):  # global pick index -> (dataset, local index)
            local = picks[(picks >= bounds[k]) & (picks < bounds[k + 1])] - bounds[k]
            if len(local):
                losses.append(per_sample_loss(trainer, params, d, local))
        scores.append(-np.concatenate(losses) if losses else np.zeros(0))
    mem, non = scores
    # A diverged model (NaN loss) tells the attacker nothing: score it as infinite loss.
    rank_mem, rank_non = (np.nan_to_num(s, nan=-np.inf) for s in (mem, non))
    return {
        "mia_auc": roc_auc(rank_mem, rank_non),
        "mia_tpr_at_1pct_fpr": tpr_at_fpr(rank_mem, rank_non, 0.01),
        "member_loss": float(-mem.mean()),
        "nonmember_loss": float(-non.mean()),
        "mia_samples": m,
    }
