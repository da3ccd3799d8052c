"""Ranking metrics per task: normalized entropy (NE), accuracy, AUC (torchmetrics' binary AUROC) and GAUC
(AUC per user, averaged weighted by the user's candidate count, over users with both label values;
vectorised over users: no library weights GAUC this way).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _dense_ranks(scores: torch.Tensor) -> torch.Tensor:
    """Scores mapped order- and tie-preserving into [0, 1] (torchmetrics reads values outside it as
    logits and applies a sigmoid, which saturates large logits into false ties)."""
    uniq, inverse = torch.unique(scores, return_inverse=True)
    return inverse.double() / max(1, uniq.numel() - 1)


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve (torchmetrics' exact binary AUROC, ties counted half); nan without both
    classes."""
    from torchmetrics.functional.classification import binary_auroc

    scores, labels = scores.double().reshape(-1), labels.reshape(-1)
    pos = int((labels > 0).sum())
    if pos == 0 or pos == labels.numel():
        return float("nan")
    return float(binary_auroc(_dense_ranks(scores), (labels > 0).long(), thresholds=None))


def normalized_entropy(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Log loss divided by the entropy of the base rate (1.0 = no better than the average)."""
    logits, labels = logits.double().reshape(-1), labels.double().reshape(-1)
    if labels.numel() == 0:
        return float("nan")
    ce = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    p = labels.mean().clamp(1e-12, 1 - 1e-12)
    base = -(p * p.log() + (1 - p) * (1 - p).log())
    return float(ce / base)


@dataclass
class MetricAccumulator:
    """Collects (logits, labels, user) of real candidates over eval batches, per task."""

    tasks: tuple[str, ...]
    _logits: list[torch.Tensor] = field(default_factory=list)
    _labels: list[torch.Tensor] = field(default_factory=list)
    _users: list[torch.Tensor] = field(default_factory=list)
    _next_user: int = 0

    def update(self, logits: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor) -> None:
        """logits/labels [B, C, T], weights [B, C] (1 for real candidates)."""
        logits, labels, weights = logits.detach().cpu(), labels.detach().cpu(), weights.detach().cpu()
        B, C = weights.shape
        users = (torch.arange(B) + self._next_user)[:, None].expand(B, C)
        self._next_user += B
        keep = weights > 0
        self._logits.append(logits[keep].float())
        self._labels.append(labels[keep].float())
        self._users.append(users[keep])

    def compute(self) -> dict[str, float]:
        """`{task}/ne`, `{task}/accuracy`, `{task}/auc`, `{task}/gauc` for every task."""
        out: dict[str, float] = {}
        if not self._logits:
            return out
        logits, labels, users = torch.cat(self._logits), torch.cat(self._labels), torch.cat(self._users)
        for t, name in enumerate(self.tasks):
            lg, lb = logits[:, t], labels[:, t]
            out[f"{name}/ne"] = normalized_entropy(lg, lb)
            out[f"{name}/accuracy"] = float(((lg > 0).double() == lb.double()).double().mean())
            out[f"{name}/auc"] = auc(lg, lb)
            out[f"{name}/gauc"] = _gauc(lg, lb, users)
        return out


def _gauc(logits: torch.Tensor, labels: torch.Tensor, users: torch.Tensor) -> float:
    """Mean per-user AUC weighted by the user's candidate count, over users with both labels: every user at
    once (Mann-Whitney U per user from ranks within the user, ties averaged), O(n log n)."""
    scores, labels = logits.double().reshape(-1), (labels.reshape(-1) > 0).double()
    _, user = torch.unique(users.reshape(-1), return_inverse=True)
    n_users = int(user.max()) + 1 if user.numel() else 0
    # sort by (user, score): stable sorts, score first
    order = torch.argsort(scores, stable=True)
    order = order[torch.argsort(user[order], stable=True)]
    u, s, lab = user[order], scores[order], labels[order]
    count = torch.zeros(n_users, dtype=torch.float64).index_add_(0, u, torch.ones_like(s))
    start = torch.cumsum(count, 0) - count  # first position of each user's block
    rank = torch.arange(1, s.numel() + 1, dtype=torch.float64) - start[u]  # 1-based within the user
    # average the ranks of equal (user, score) pairs
    _, tie = torch.unique(torch.stack([u.double(), s]), dim=1, return_inverse=True)
    tie_sum = torch.zeros(int(tie.max()) + 1 if tie.numel() else 0, dtype=torch.float64).index_add_(
        0, tie, rank
    )
    tie_n = torch.zeros_like(tie_sum).index_add_(0, tie, torch.ones_like(rank))
    rank = (tie_sum / tie_n)[tie]
    pos = torch.zeros(n_users, dtype=torch.float64).index_add_(0, u, lab)
    neg = count - pos
    pos_rank = torch.zeros(n_users, dtype=torch.float64).index_add_(0, u, rank * lab)
    both = (pos > 0) & (neg > 0)
    if not bool(both.any()):
        return float("nan")
    per_user = (pos_rank[both] - pos[both] * (pos[both] + 1) / 2) / (pos[both] * neg[both])
    return float((per_user * count[both]).sum() / count[both].sum())
