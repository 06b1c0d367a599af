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

import numpy as np
import torch
import torch.nn.functional as F

from shoal.client.training import LocalTrainer


@torch.no_grad()
def per_sample_loss(trainer: LocalTrainer, params: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
                    batch_size: int = 2048) -> np.ndarray:
    """Cross-entropy of each sample under ``params`` (leaves the trainer's buffer changed)."""
    trainer.flat.copy_(params.to(trainer.device))
    trainer.model.eval()
    out = [
        F.cross_entropy(trainer.model(x[i : i + batch_size].to(trainer.device)),
                        y[i : i + batch_size].to(trainer.device), reduction="none").double().cpu()
        for i in range(0, len(y), batch_size)
    ]
    return torch.cat(out).numpy()


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


def loss_threshold_audit(trainer: LocalTrainer, params: torch.Tensor,
                         members: tuple[torch.Tensor, torch.Tensor],
                         nonmembers: tuple[torch.Tensor, torch.Tensor],
                         samples: int, seed: int) -> dict[str, float]:
    """AUC and TPR at 1% FPR of the loss attack on equal-sized random draws of each set."""
    gen = np.random.default_rng(seed)
    m = min(samples, len(members[1]), len(nonmembers[1]))
    scores = []
    for x, y in (members, nonmembers):
        idx = torch.as_tensor(np.sort(gen.choice(len(y), size=m, replace=False)))
        scores.append(-per_sample_loss(trainer, params, x[idx.to(x.device)], y[idx.to(y.device)]))
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
