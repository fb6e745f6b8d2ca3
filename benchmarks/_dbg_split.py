import torch, sys
sys.path.insert(0, "benchmarks")
from diag_fp8_split_act import SplitAct, split_act_ref
torch.manual_seed(0)
dev = "cuda"
T, K, N = 32, 4096, 4096
x = torch.randn(T, K, dtype=torch.bfloat16, device=dev)
w = (torch.randn(N, K, device=dev) * 40).to(torch.float8_e4m3fn); sc = torch.ones(N, device=dev)
op = SplitAct(x, N, (64, 64, 128, 4, 3, 1))
op.quantize()
xf = x.float(); s = xf.abs().amax(1, keepdim=True) / 448
h = (xf / s).to(torch.float8_e4m3fn); l = ((xf/s - h.float())*16).to(torch.float8_e4m3fn)
print("s", (op.s - s[:,0]).abs().max().item())
print("h mismatch", (op.q[:,0].float() != h.float()).sum().item(), "l mismatch", (op.q[:,1].float() != l.float()).sum().item())
for cfg in ((64, 64, 128, 4, 3, 1),):
    op2 = SplitAct(x, N, cfg); op2.q[:, 0] = h; op2.q[:, 1] = 0; op2.s.fill_(1.0)
    got = op2.gemm(w, sc).float(); ref = (h.float() @ w.float().T)
    print(cfg, "h only", ((got - ref).norm() / ref.norm()).item())
    op2.q[:, 1] = h; op2.q[:, 0] = 0
    got = op2.gemm(w, sc).float(); ref = (h.float()/16 @ w.float().T)
    print(cfg, "l only", ((got - ref).norm() / ref.norm()).item())
    print(got[:2,:4], ref[:2,:4])
xs = xf / s
i = (op.q[:,1].float() != l.float()).nonzero()[:8]
for a, b in i.tolist():
    print(xs[a, b].item(), h[a, b].float().item(), (xs[a,b]-h[a,b].float()).item()*16, op.q[a,1,b].float().item(), l[a,b].float().item())
