# Oracle for optim_adamw_test: runs torch.optim.AdamW on the parameters and per-step
# gradients the test wrote, and writes the parameters and moments after every step.
# usage: torch_adamw.py <dir>   reads  dir/in.f32 = [n params | steps x n grads] and
# dir/hp.txt = "n steps lr beta1 beta2 eps weight_decay"; writes dir/out.f32 = steps x [params | m | v].
import sys
import numpy as np
import torch

d = sys.argv[1]
n, steps, lr, b1, b2, eps, wd = open(d + "/hp.txt").read().split()
n, steps = int(n), int(steps)
data = np.fromfile(d + "/in.f32", dtype=np.float32)
p = torch.nn.Parameter(torch.from_numpy(data[:n].copy()))
grads = data[n:].reshape(steps, n)
opt = torch.optim.AdamW([p], lr=float(lr), betas=(float(b1), float(b2)), eps=float(eps), weight_decay=float(wd))
out = []
for s in range(steps):
    p.grad = torch.from_numpy(grads[s].copy())
    opt.step()
    st = opt.state[p]
    out += [p.detach().numpy().copy(), st["exp_avg"].numpy().copy(), st["exp_avg_sq"].numpy().copy()]
np.concatenate(out).astype(np.float32).tofile(d + "/out.f32")
