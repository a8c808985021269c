import torch, torch.nn.functional as F
from passes.fuse_linear_cross_entropy import fused_linear_cross_entropy
torch.manual_seed(0)
for dt in [torch.float32, torch.bfloat16]:
  for eps, cap, red in [(0.0,None,"mean"),(0.1,None,"sum"),(0.0,30.0,"mean")]:
    h = torch.randn(2,50,16,dtype=dt,requires_grad=True); W=torch.randn(97,16,dtype=dt,requires_grad=True); b=torch.randn(97,dtype=dt,requires_grad=True)
    t = torch.randint(0,97,(100,)); t[::3]=-100
    z = F.linear(h,W,b)
    if cap: z = torch.tanh(z/cap)*cap
    ref = F.cross_entropy(z.float().view(-1,97), t, ignore_index=-100, reduction=red, label_smoothing=eps)
    g = torch.autograd.grad(ref*1.7,[h,W,b])
    got = fused_linear_cross_entropy(h,W,b,t,-100,red,eps,cap,chunk=7)
    g2 = torch.autograd.grad(got*1.7,[h,W,b])
    print(dt, eps, cap, red, (ref-got).abs().item(), [ (a-c).abs().max().item() for a,c in zip(g,g2)])
