"""Train a tiny character-level MoE transformer on examples/data/kittens.txt, MoK's layer against the
pure-torch layer.

Both runs build the same model from the same seed (a ``mok.MoE`` feed-forward in every block, with
its router and a shared expert); the reference run computes the MoE layer with
``mok.testing.moe_reference`` on the very same parameters, MoK's run with ``mok.MoE`` itself. A
second MoK run checks that training is bitwise reproducible (identical losses). The loss curves go
to examples/loss.png.

    python examples/train_tiny_lm.py                # CPU: about a minute on 2 cores
    python examples/train_tiny_lm.py --steps 400 --device cuda
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "python"))  # run from a checkout without installing

import mok  # noqa: E402
from mok import testing  # noqa: E402


@dataclass(frozen=True)
class Config:
    vocab: int
    dim: int = 64
    heads: int = 4
    layers: int = 2
    seq: int = 64
    experts: int = 8
    topk: int = 2
    expert_dim: int = 96
    shared_dim: int = 64


class MoeFeedForward(nn.Module):
    """The block's feed-forward: ``mok.MoE``; with ``impl="torch"`` the same parameters and router
    through the pure-torch reference layer instead."""

    def __init__(self, cfg: Config, impl: str) -> None:
        super().__init__()
        self.impl = impl
        self.moe = mok.MoE(cfg.experts, cfg.dim, cfg.expert_dim, cfg.topk, shared_intermediate=cfg.shared_dim,
                           router="softmax")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.impl == "mok":
            return self.moe(x)
        m = self.moe
        rows = x.reshape(-1, x.shape[-1])
        topk_idx, topk_w = m.router(rows)
        y = testing.moe_reference(rows.bfloat16(), topk_idx, topk_w, m.w_gate, m.w_up, m.w_down,
                                  (m.shared_gate, m.shared_up, m.shared_down))
        return y.to(x.dtype).reshape(x.shape)


class Block(nn.Module):
    def __init__(self, cfg: Config, impl: str) -> None:
        super().__init__()
        self.heads = cfg.heads
        self.norm1, self.norm2 = nn.LayerNorm(cfg.dim), nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.proj = nn.Linear(cfg.dim, cfg.dim, bias=False)
        self.ffn = MoeFeedForward(cfg, impl)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, S, 3, self.heads, D // self.heads).unbind(2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, D))
        return x + self.ffn(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self, cfg: Config, impl: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.dim)
        nn.init.normal_(self.embed.weight, std=0.02)  # tied output layer: small initial logits
        self.position = nn.Parameter(torch.randn(cfg.seq, cfg.dim) * 0.02)
        self.blocks = nn.ModuleList(Block(cfg, impl) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.dim)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.norm(x) @ self.embed.weight.t()  # tied output layer


def batches(data: torch.Tensor, cfg: Config, batch: int, steps: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - cfg.seq - 1, (steps, batch), generator=g)
    return [torch.stack([data[s : s + cfg.seq + 1] for s in row.tolist()]) for row in starts]


def train(impl: str, data: torch.Tensor, held_out: torch.Tensor, cfg: Config, args: argparse.Namespace,
          device: torch.device, label: str) -> tuple[list[float], float, TinyLM]:
    torch.manual_seed(args.seed)  # the same initial model for every run
    model = TinyLM(cfg, impl).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20)
                                                 * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    losses = []
    bar = tqdm(batches(data, cfg, args.batch, args.steps, args.seed), desc=label, unit="step", leave=True)
    for chunk in bar:
        chunk = chunk.to(device)
        logits = model(chunk[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, cfg.vocab), chunk[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        schedule.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.3f}")
    with torch.no_grad():
        held = torch.stack([F.cross_entropy(model(c[:, :-1].to(device)).reshape(-1, cfg.vocab),
                                            c[:, 1:].reshape(-1).to(device))
                            for c in batches(held_out, cfg, args.batch, 8, seed=1)]).mean().item()
    return losses, held, model


@torch.no_grad()
def sample(model: TinyLM, chars: list[str], cfg: Config, device: torch.device, prompt: str, n: int) -> str:
    index = {c: i for i, c in enumerate(chars)}
    tokens = torch.tensor([[index[c] for c in prompt]], device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for _ in range(n):
        logits = model(tokens[:, -cfg.seq :])[0, -1]
        nxt = torch.multinomial(torch.softmax(logits / 0.8, dim=-1), 1, generator=g)
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    return "".join(chars[i] for i in tokens[0].tolist())


def pick_device(name: str) -> torch.device:
    if name != "auto":
        return torch.device(name)
    if torch.cuda.is_available():
        try:  # MoK's kernels may not be built for this GPU: say so and train on the CPU
            x = torch.zeros(1, 8, dtype=torch.bfloat16, device="cuda")
            w = torch.zeros(1, 8, 8, dtype=torch.bfloat16, device="cuda")
            mok.moe(x, torch.zeros(1, 1, dtype=torch.int64, device="cuda"), torch.ones(1, 1, device="cuda"), w, w, w)
            return torch.device("cuda")
        except NotImplementedError as e:
            print(f"note: {e}; training on the CPU")
    return torch.device("cpu")


def plot(curves: dict[str, list[float]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    styles = {"MoK": dict(lw=2.2, color="tab:blue"), "MoK (rerun)": dict(lw=1.0, ls=":", color="black"),
              "pure torch": dict(lw=1.2, ls="--", color="tab:orange")}
    for name, losses in curves.items():
        ax.plot(range(1, len(losses) + 1), losses, label=name, **styles.get(name, {}))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats/char)")
    ax.set_title(title, fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (GPU when MoK's kernels run there), cpu, cuda")
    parser.add_argument("--corpus", type=Path, default=HERE / "data" / "kittens.txt")
    parser.add_argument("--out", type=Path, default=HERE / "loss.png")
    args = parser.parse_args()
    torch.use_deterministic_algorithms(True)
    device = pick_device(args.device)

    text = args.corpus.read_text()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text])
    split = int(0.9 * data.numel())
    cfg = Config(vocab=len(chars))
    print(f"corpus {args.corpus.name}: {len(text)} chars, vocab {len(chars)}; {args.steps} steps of "
          f"{args.batch}x{cfg.seq} tokens on {device}")

    start = time.monotonic()
    runs: dict[str, list[float]] = {}
    runs["MoK"], held_mok, model = train("mok", data[:split], data[split:], cfg, args, device, "MoK")
    runs["MoK (rerun)"], _, _ = train("mok", data[:split], data[split:], cfg, args, device, "MoK, again")
    runs["pure torch"], held_torch, _ = train("torch", data[:split], data[split:], cfg, args, device, "pure torch")

    params = sum(p.numel() for p in model.parameters())
    final = {name: sum(v[-10:]) / 10 for name, v in runs.items()}
    print(f"final training loss (mean of the last 10 steps): MoK {final['MoK']:.4f}, pure torch "
          f"{final['pure torch']:.4f}; held-out loss: MoK {held_mok:.4f}, pure torch {held_torch:.4f}")
    identical = runs["MoK"] == runs["MoK (rerun)"]
    print(f"two MoK runs, same seed: {'identical losses at every step' if identical else 'DIFFERENT losses'}")
    print("sample:", repr(sample(model, chars, cfg, device, "The kittens ", 120)))
    title = (f"tiny MoE char LM ({params / 1e3:.0f}k params, {cfg.layers} MoE blocks, E={cfg.experts}, "
             f"k={cfg.topk}, shared expert), {device.type}")
    plot(runs, args.out, title)
    print(f"wrote {args.out} ({time.monotonic() - start:.0f} s)")
    if not identical:
        raise SystemExit("MoK runs with the same seed gave different losses")


if __name__ == "__main__":
    main()
