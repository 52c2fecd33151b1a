"""End to end: a training step of a decoder whose feed-forwards are MoE layers, with MoK's layer
against the torch baseline layer on the same parameters and the same data: one GPU, or one
expert-parallel group under torchrun.

The model is L pre-norm blocks, ``x + attn(norm(x))`` then ``x + moe(norm(x))``, between a token
embedding and an LM head. Attention is torch's (``scaled_dot_product_attention``, causal, heads of
128 where the width allows); every MoE is a ``mok.MoE`` with its router (softmax top-k) and, where the preset has one, a
shared expert. Two copies of the model start from the same parameters:

===========  ====================================================================================
mok          ``mok.MoE.forward`` (on the GPU: the forward and backward megakernels; ``--precision``
             fp8 / fp8_dgrad for MoK's block-scaled e4m3 paths)
torch        the same module's parameters and router through the torch baseline (a): sort the
             (token, j) slots by expert, ``all_to_all_single`` dispatch (ranks > 1),
             ``torch._grouped_mm`` gate and up, SwiGLU, ``torch._grouped_mm`` down, combine,
             un-sort, the fp32 weighted sum (bench/impls/torch_a2a.py: ``alltoall_moe``)
===========  ====================================================================================

With ``--compile`` every block of both copies runs under ``torch.compile`` (MoK's layer is one op in
the graph); ``--compile both`` adds compiled copies beside the eager ones, four copies in turn.

A step is forward, cross-entropy loss, backward and ``torch.optim.AdamW`` (fused on the GPU); both copies take their
steps in turn (mok, torch, mok, ...) on the same batches, so clocks under the power cap treat them
alike. Printed per preset: the median step time of each, tokens per second, torch's time over
MoK's (the end-to-end speedup), the peak memory forward and backward add over the resident model
(the activations; the optimizer's temporaries come after), and the first step's losses (the same parameters and batch: they must agree to bf16 rounding, or the run fails).

    python -m bench.train --presets qwen3-30b-a3b,gpt-oss-120b --layers 4 --tokens 8192   # one GPU
    python -m bench.train --smoke                                                        # CPU, tiny
    python -m bench.train --precision fp8 --profile 30     # and where one step of each copy spends its time
    python -m bench.train --compile                        # every block of both copies under torch.compile
    python -m bench.train --compile both                   # eager and compiled copies, in turn in one process
    torchrun --standalone --nproc-per-node 2 -m bench.train --presets kimi-k2 --experts 96 --layers 2

Under torchrun the ranks are one expert-parallel group (MoK's layer over it, the baseline with
NCCL ``all_to_all_single``) and data-parallel for the rest: each rank its own batches, the
replicated parameters' gradients averaged in one all-reduce (both copies alike); the step time is
the slowest rank's, tokens per second the group's.

``--experts E`` keeps fewer routed experts than the preset (the same H, I, top-k) so that a large
preset's layers fit one GPU with their gradients and optimizer state; the row names it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import mok  # (bench/__init__.py puts python/ on the path)

from .impls._common import grouped_swiglu_mlp, shared_expert
from .impls.torch_a2a import alltoall_moe
from .presets import Preset, get_preset

IMPLS = ("mok", "torch")


def torch_moe(moe: mok.MoE, x: torch.Tensor, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``moe``'s layer (router, routed experts, shared expert) through the torch baseline (a) on this
    rank's tokens: all_to_all_single dispatch and combine over ``group`` (none at one rank), rows
    grouped by expert, ``torch._grouped_mm`` SwiGLU MLP, the fp32 weighted sum."""
    topk_idx, topk_w = moe.router(x)
    shared = (moe.shared_gate, moe.shared_up, moe.shared_down) if moe.shared_gate is not None else None

    def experts(x_sorted: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        return grouped_swiglu_mlp(x_sorted, offs, moe.w_gate, moe.w_up, moe.w_down, moe.swiglu_limit)

    return alltoall_moe(x, topk_idx, topk_w, experts, shared_expert(x, shared, moe.swiglu_limit), moe.local_experts,
                        group)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.weight


class Attention(nn.Module):
    def __init__(self, dim: int, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        # Heads of 128 where the width allows, else the largest power of two dividing it
        # (gpt-oss's 2880 = 45 heads of 64).
        head_dim = next(d for d in (128, 64, 32, 16, 8, 4, 2, 1) if dim % d == 0)
        self.heads = dim // head_dim
        self.qkv = nn.Linear(dim, 3 * dim, bias=False, device=device, dtype=dtype)
        self.out = nn.Linear(dim, dim, bias=False, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, D // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(B, S, D))


class Block(nn.Module):
    def __init__(self, p: Preset, experts: int, device: torch.device, dtype: torch.dtype,
                 config: mok.MoeConfig | None, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.group = group
        self.norm1 = RMSNorm(p.H, device, dtype)
        self.attn = Attention(p.H, device, dtype)
        self.norm2 = RMSNorm(p.H, device, dtype)
        self.moe = mok.MoE(experts, p.H, p.I, p.topk, shared_intermediate=p.shared_I, swiglu_limit=p.swiglu_limit,
                           router="softmax", group=group, dtype=dtype, device=device, config=config)
        self.impl = "mok"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        h = self.norm2(x).reshape(-1, x.shape[-1])
        y = self.moe(h) if self.impl == "mok" else torch_moe(self.moe, h, self.group)
        return x + y.view_as(x)


class Decoder(nn.Module):
    def __init__(self, p: Preset, experts: int, layers: int, vocab: int, device: torch.device, dtype: torch.dtype,
                 config: mok.MoeConfig | None, group: dist.ProcessGroup | None = None) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, p.H, device=device, dtype=dtype)
        self.blocks = nn.ModuleList(Block(p, experts, device, dtype, config, group) for _ in range(layers))
        self.norm = RMSNorm(p.H, device, dtype)
        self.head = nn.Linear(p.H, vocab, bias=False, device=device, dtype=dtype)

    def set_impl(self, impl: str) -> None:
        for b in self.blocks:
            b.impl = impl

    def loss(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens[:, :-1])
        for b in self.blocks:
            x = b(x)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    def average_replicated_grads(self, group: dist.ProcessGroup | None) -> None:
        """Data parallelism over the EP group: every parameter but the routed experts' (each rank's
        own, whose gradients already sum over every rank's tokens) is replicated; their gradients
        are averaged, in one all-reduce."""
        if group is None or dist.get_world_size(group) == 1:
            return
        grads = [p.grad for name, p in self.named_parameters()
                 if p.grad is not None and name.rsplit(".", 1)[-1] not in ("w_gate", "w_up", "w_down")]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat, group=group)
        flat /= dist.get_world_size(group)
        offset = 0
        for g in grads:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


@dataclass
class Row:
    preset: str
    experts: int
    layers: int
    ranks: int
    tokens: int  # per rank
    seq: int
    impl: str
    precision: str
    step_ms: float
    tokens_per_s: float
    speedup_vs_torch: float
    activation_peak_bytes: int  # forward + backward over the resident model
    first_loss: float
    compiled: bool = False  # --compile: every block under torch.compile (both copies)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train_step(model: Decoder, opt: torch.optim.Optimizer, tokens: torch.Tensor, group: dist.ProcessGroup | None,
               device: torch.device) -> tuple[torch.Tensor, int]:
    """One training step of ``model`` (forward, loss, backward, the replicated gradients' average,
    AdamW), finished on the device: its loss and the peak bytes forward and backward added over
    what was resident before (the activations; AdamW's temporaries come after; 0 on the CPU)."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        resident = torch.cuda.memory_allocated(device)
    loss = model.loss(tokens)
    loss.backward()
    model.average_replicated_grads(group)
    peak = torch.cuda.max_memory_allocated(device) - resident if cuda else 0
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(device)
    return loss, peak


def profile_step(model: Decoder, opt: torch.optim.Optimizer, tokens: torch.Tensor, group: dist.ProcessGroup | None,
                 device: torch.device, top: int) -> str:
    """One training step of ``model`` under torch.profiler: its ``top`` entries by self time on the
    device (on the CPU when there is no GPU), as the profiler's table."""
    from torch.profiler import ProfilerActivity, profile
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _sync(device)
    with profile(activities=activities) as prof:
        train_step(model, opt, tokens, group, device)
    return prof.key_averages().table(sort_by="self_device_time_total" if cuda else "self_cpu_time_total",
                                     row_limit=top)


def run_preset(p: Preset, args: argparse.Namespace, device: torch.device,
               group: dist.ProcessGroup | None = None) -> list[Row]:
    experts = args.experts or p.E
    ranks = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    if experts < p.topk:
        raise ValueError(f"--experts {experts} is fewer than {p.name}'s top-k {p.topk}")
    if experts % ranks != 0:
        raise ValueError(f"--experts {experts} does not split over {ranks} ranks")
    seq = min(args.seq, args.tokens)
    batch = max(1, args.tokens // seq)
    dtype = torch.bfloat16
    config = None if args.precision == "bf16" else mok.MoeConfig(precision=args.precision)

    def build(impl: str, compiled: bool) -> Decoder:
        # The same seed for every copy and on every rank: the copies start equal, and so do the
        # replicated parameters across ranks (each rank's experts start as the others' do; the
        # timing does not care).
        torch.manual_seed(args.seed)
        model = Decoder(p, experts, args.layers, args.vocab, device, dtype, config, group)
        model.set_impl(impl)
        if compiled:  # each block compiled, as frameworks compile a transformer block
            for block in model.blocks:
                block.compile()
        return model

    # The copies: (key, impl, compiled). --compile both: eager and compiled copies of each layer in
    # one process, taking their steps in turn (a same-process A/B of compiling).
    modes = {"off": (False,), "on": (True,), "both": (False, True)}[args.compile]
    copies = [(impl + ("+compile" if c else ""), impl, c) for c in modes for impl in IMPLS]
    keys = [key for key, _, _ in copies]
    models = {key: build(impl, c) for key, impl, c in copies}
    # AdamW in one fused kernel per step on the GPU, as training frameworks run it (the foreach form
    # took ~34 of ~80 ms a step here, the same in both copies); foreach on the CPU.
    fused = device.type == "cuda"
    optims = {key: torch.optim.AdamW(m.parameters(), lr=args.lr, fused=fused, foreach=not fused)
              for key, m in models.items()}
    gen = torch.Generator(device="cpu").manual_seed(args.seed + 1 + rank)  # each rank its own batches
    batches = [torch.randint(0, args.vocab, (batch, seq + 1), generator=gen).to(device) for _ in range(4)]

    times: dict[str, list[float]] = {key: [] for key in keys}
    peaks: dict[str, int] = {key: 0 for key in keys}
    first: dict[str, float] = {}
    for step in range(args.warmup + args.steps):
        tokens = batches[step % len(batches)]
        for key in keys:
            _sync(device)
            t0 = time.perf_counter()
            loss, peak = train_step(models[key], optims[key], tokens, group, device)
            elapsed = time.perf_counter() - t0
            if step == 0:
                first[key] = float(loss.detach())
            if step >= args.warmup:
                times[key].append(elapsed)
                peaks[key] = max(peaks[key], peak)
    # The same parameters and batch: every copy's first loss agrees with the first torch copy's to
    # the layers' bf16 rounding, on every rank; every rank learns of any rank's disagreement and
    # raises (none is left in a collective).
    base = next(key for key, impl, _ in copies if impl == "torch")
    agree = all(math.isclose(first[key], first[base], rel_tol=args.loss_rtol) for key in keys)
    disagreeing = [] if agree else [rank]
    if ranks > 1:
        flags = torch.zeros(ranks, dtype=torch.int32, device=device)
        flags[rank] = 0 if agree else 1
        dist.all_reduce(flags, group=group)
        disagreeing = [r for r, f in enumerate(flags.tolist()) if f]
    if disagreeing:
        losses = ", ".join(f"{key} {first[key]:.6f}" for key in keys)
        raise RuntimeError(f"{p.name}: the first-step losses differ beyond {args.loss_rtol} on rank(s) "
                           f"{disagreeing} (this rank {rank}: {losses})")
    if ranks > 1:  # each step's time is the slowest rank's; the peaks the largest
        for key in keys:
            t = torch.tensor(times[key] + [float(peaks[key])], dtype=torch.float64, device=device)
            dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
            times[key], peaks[key] = t[:-1].tolist(), int(t[-1].item())
    if args.profile:  # one more step of each copy under the profiler (every rank: collectives), rank 0 prints
        tokens = batches[0]
        for key, impl, _ in copies:
            table = profile_step(models[key], optims[key], tokens, group, device, args.profile)
            if rank == 0:
                print(f"### {p.name}, {key} ({args.precision if impl == 'mok' else 'bf16'}): one step's top "
                      f"{args.profile} entries by self time\n" + table, flush=True)
    median = {key: statistics.median(times[key]) for key in keys}
    rows = []
    for key, impl, compiled in copies:
        torch_key = "torch+compile" if compiled else "torch"  # against the torch copy compiled alike
        rows.append(Row(p.name if experts == p.E else f"{p.name} ({experts} experts)", experts, args.layers, ranks,
                        batch * seq, seq, impl, args.precision if impl == "mok" else "bf16", 1e3 * median[key],
                        ranks * batch * seq / median[key], median[torch_key] / median[key], peaks[key], first[key],
                        compiled))
    del models, optims
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def render(rows: list[Row]) -> str:
    lines = ["| preset | layers | ranks | tokens per rank | impl | precision | step ms | tokens/s | torch / this | "
             "fwd+bwd peak GiB | first loss (rank 0) |",
             "|---|---:|---:|---:|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        impl = f"{r.impl} (compiled)" if r.compiled else r.impl
        lines.append(f"| {r.preset} | {r.layers} | {r.ranks} | {r.tokens} | {impl} | {r.precision} | {r.step_ms:.2f} | "
                     f"{r.tokens_per_s:,.0f} | {r.speedup_vs_torch:.3f}x | {r.activation_peak_bytes / 2**30:.2f} | "
                     f"{r.first_loss:.5f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", default="qwen3-30b-a3b", help="comma-separated bench.presets names")
    ap.add_argument("--experts", type=int, default=0, help="routed experts kept (0: the preset's)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per step (batch x sequence)")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per impl")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--precision", default="bf16", choices=("bf16", "fp8", "fp8_dgrad"), help="MoK's layer precision")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--loss-rtol", type=float, default=2e-3, help="first-step losses must agree this closely")
    ap.add_argument("--device", default=None, help="default: cuda when present, else cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny preset, 2 layers, 64 tokens, 2 steps (CPU plumbing)")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the timing, profile one more step of each copy and print its top N entries")
    ap.add_argument("--compile", nargs="?", const="on", default="off", choices=("off", "on", "both"),
                    help="torch.compile every block of both copies (MoK's layer is one op in the graph); 'both': "
                         "eager and compiled copies of each in one process")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.smoke:
        args.presets, args.layers, args.tokens, args.seq, args.vocab = "tiny", 2, 64, 32, 256
        args.steps, args.warmup = 2, 1
    group = None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # torchrun: expert parallelism over every process
        cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
        group = dist.group.WORLD
        device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    else:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        rows: list[Row] = []
        for name in args.presets.split(","):
            rows += run_preset(get_preset(name.strip()), args, device, group)
    finally:
        if group is not None:
            dist.destroy_process_group()
    if group is not None and int(os.environ.get("RANK", "0")) != 0:
        return rows
    print(render(rows))
    if args.out is not None:
        meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                "torch": torch.__version__, "argv": sys.argv[1:] if argv is None else argv}
        args.out.write_text(json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=1))
    return rows


if __name__ == "__main__":
    main()
