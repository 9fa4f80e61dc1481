"""Does a torch op writing into CUDA memory torch did not allocate (a view
made through __cuda_array_interface__, as amaxd.device makes the device
slab) block the host? Each write is queued behind a ~250 ms kernel on a
side stream; the host time of the call is printed (0.x ms: asynchronous).
Seen on torch 2.11 + H100: what blocks is the first launch of each kernel
in the process (CUDA lazy module loading waits for the device), whatever
memory it writes; run with CUDA_MODULE_LOADING=EAGER and nothing blocks.
"""
import time

import cupy
import torch
from cupy.cuda import runtime as rt


class CAI:
    def __init__(s, p, n):
        s.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (p, False),
                                      "version": 3, "strides": None, "stream": None}


n = 20000
p = rt.malloc(4 * n)
v = torch.as_tensor(CAI(p, n), device="cuda")
mem = cupy.cuda.UnownedMemory(p, 4 * n, None)
vd = torch.from_dlpack(cupy.ndarray((n,), cupy.float32, cupy.cuda.MemoryPointer(mem, 0)))
x = torch.rand(2, n, device="cuda")
y = torch.rand(n, device="cuda")
w = torch.rand(64, 64, device="cuda")
t = torch.empty(n, device="cuda")
s = torch.cuda.Stream()
torch.cuda.synchronize()
cases = [
    ("torch.amax(x, dim=0, out=view)", lambda: torch.amax(x, dim=0, out=v)),
    ("torch.amax(w.abs(), out=view[3])", lambda: torch.amax(w.abs(), out=v[3])),
    ("view[3:4].copy_(torch.amax(w.abs()))", lambda: v[3:4].copy_(torch.amax(w.abs()))),
    ("torch.maximum(x[0], x[1], out=view)", lambda: torch.maximum(x[0], x[1], out=v)),
    ("view.copy_(y)", lambda: v.copy_(y)),
    ("torch.amax(x, dim=0, out=dlpack_view)", lambda: torch.amax(x, dim=0, out=vd)),
    ("torch.maximum(x[0], x[1], out=dlpack_view)", lambda: torch.maximum(x[0], x[1], out=vd)),
    ("view.add_(0) (in place, no out=)", lambda: v.add_(0)),
    ("torch.amax(x, dim=0, out=tmp); view.copy_(tmp)",
     lambda: (torch.amax(x, dim=0, out=t), v.copy_(t))),
    ("torch.amax(x, dim=0, out=torch_tensor)", lambda: torch.amax(x, dim=0, out=y)),
]
for name, fn in cases:
    with torch.cuda.stream(s):
        torch.cuda._sleep(400_000_000)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
    s.synchronize()
    print(f"{name:50s} host blocked {dt * 1e3:7.1f} ms")
