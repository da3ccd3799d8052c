"""Ranking metrics per task in torch: normalized entropy (NE), accuracy, AUC and GAUC (AUC per
user, averaged weighted by the user's candidate count, over users with both label values).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """Area under the ROC curve with ties averaged (Mann-Whitney U); nan without both classes."""
    scores, labels = scores.double().reshape(-1), labels.double().reshape(-1)
    pos = labels.sum()
    neg = labels.numel() - pos
    if pos == 0 or neg == 0:
        return float("nan")
    order = torch.argsort(scores)
    s = scores[order]
    ranks = torch.empty_like(s)
    ranks[order] = torch.arange(1, s.numel() + 1, dtype=torch.float64)
    # average the ranks of tied scores
    uniq, inverse = torch.unique(scores, return_inverse=True)
    sums = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, ranks)
    counts = torch.zeros(uniq.numel(), dtype=torch.float64).index_add_(0, inverse, torch.ones_like(ranks))
    avg = (sums / counts)[inverse]
    return float(((avg * labels).sum() - pos * (pos + 1) / 2) / (pos * neg))


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
    total, weight = 0.0, 0.0
    for u in torch.unique(users):
        sel = users == u
        a = auc(logits[sel], labels[sel])
        if a == a:  # not nan: the user has both labels
            n = float(sel.sum())
            total, weight = total + a * n, weight + n
    return total / weight if weight else float("nan")
