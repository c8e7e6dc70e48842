import torch
from onlineattn.ops import forward as F
g = torch.Generator().manual_seed(6)
q = torch.randn(2, 9, 4, 40, generator=g).half().cuda(); k = torch.randn(2, 13, 2, 40, generator=g).half().cuda(); v = torch.randn(2, 13, 2, 24, generator=g).half().cuda()
o, lse = F.forward(q, k, v, 0.25, True); torch.cuda.synchronize(); print("direct ok")
o, lse = F.forward(q.clone(), k.clone(), v.clone(), 0.25, True); torch.cuda.synchronize(); print("direct again ok")
torch.library.opcheck(torch.ops.onlineattn.attention_fwd, (q, k, v, 0.25, True), test_utils=("test_schema",)); torch.cuda.synchronize(); print("opcheck ok")
