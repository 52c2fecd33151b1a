import os, sys, time, torch, mok
from mok import testing, _cuda_layer
H, I, E, k, T, S = (int(a) for a in sys.argv[1:7])
prec = sys.argv[7]
ballast_gb = float(sys.argv[8]) if len(sys.argv) > 8 else 0
ballast = torch.empty(int(ballast_gb * 2**30), dtype=torch.uint8, device="cuda") if ballast_gb else None
p = testing.random_problem(T, E, H, I, k, shared_intermediate=S, seed=1, device="cuda")
leaves = [t.detach().clone().requires_grad_(True) for t in (p.x, p.topk_w, p.w_gate, p.w_up, p.w_down)]
shared = [t.detach().clone().requires_grad_(True) for t in p.shared] if p.shared is not None else None
cfg = mok.MoeConfig(precision=prec)
dy = torch.randn(T, H, device="cuda").to(torch.bfloat16)
y = mok.moe(leaves[0], p.topk_idx, leaves[1], *leaves[2:], shared, config=cfg)
torch.cuda.synchronize(); print("forward ok; free GB", torch.cuda.mem_get_info()[0] / 2**30, flush=True)
g = torch.autograd.grad(y, leaves + (shared or []), dy)
torch.cuda.synchronize(); print("backward ok; free GB", torch.cuda.mem_get_info()[0] / 2**30, flush=True)
_cuda_layer.check(); print("PASS", sys.argv[1:])
