"""Capture time and per-phase node counts for the reference models and a transformer-sized model.

Not a test: `uv run python benchmarks/capture.py [--layers 12 --width 768 --optimizer adamw_amsgrad]`.
Capture traces with fake tensors, so its cost grows with the number of ops, not with tensor sizes.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from recir.capture import capture_train_step, testing
from torch import nn


class _Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))
        self.drop = nn.Dropout(0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (t.reshape(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, d)
        x = x + self.drop(self.proj(a))
        return x + self.drop(self.mlp(self.ln2(x)))


class TransformerLM(nn.Module):
    """A GPT-style language model: token + position embeddings, N blocks, tied-free LM head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList([_Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def _lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())


def _report(name: str, model: nn.Module, opt_name: str, loss_fn, batch, overrides=()) -> None:
    optimizer = testing.make_optimizer(opt_name, model.parameters())
    t0 = time.perf_counter()
    step = capture_train_step(model, optimizer, loss_fn, batch, overrides=overrides)
    seconds = time.perf_counter() - t0
    counts = step.phase_counts()
    params = sum(p.numel() for p in model.parameters())
    print(
        f"{name:<28} {opt_name:<16} {params / 1e6:8.2f}M params  capture {seconds:6.2f}s  "
        f"nodes {len(step.graph.nodes):6d}  forward {counts['forward']:5d}  backward {counts['backward']:5d}  "
        f"optimizer {counts['optimizer']:5d}  state slots {len(step.signature.state)}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--optimizer", default="adamw_amsgrad", choices=sorted(testing.OPTIMIZERS))
    args = parser.parse_args()

    for name, case in testing.REFERENCE_CASES.items():
        _report(name, case.build(0), args.optimizer, case.loss_fn, case.make_batch(0), case.overrides())
    torch.manual_seed(0)
    with torch.device("meta"):
        lm = TransformerLM(args.vocab, args.width, args.heads, args.layers, args.seq)
    # capture never reads parameter values, so a meta-device model of any size is enough
    lm = lm.to_empty(device="cpu")
    batch = {
        "ids": torch.randint(0, args.vocab, (2, args.seq)),
        "labels": torch.randint(0, args.vocab, (2, args.seq)),
    }
    _report(f"transformer-lm {args.layers}x{args.width}", lm, args.optimizer, _lm_loss, batch)


if __name__ == "__main__":
    main()
