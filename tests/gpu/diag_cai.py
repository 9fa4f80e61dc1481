import time, torch, cupy
from cupy.cuda import runtime as rt
# Memory from cudaMalloc wrapped via CAI: does a torch kernel writing into it block the host?
class CAI:
    def __init__(s, p, n): s.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (p, False), "version": 3, "strides": None, "stream": None}
n = 20000
p = rt.malloc(4 * n)
v = torch.as_tensor(CAI(p, n), device="cuda")
x = torch.rand(2, n, device="cuda"); y = torch.rand(n, device="cuda")
s = torch.cuda.Stream(); torch.cuda.synchronize()
for name, fn in [("amax", lambda: torch.amax(x, dim=0, out=v)), ("copy", lambda: v.copy_(y)), ("amax-normal", lambda: torch.amax(x, dim=0, out=y))]:
    with torch.cuda.stream(s):
        torch.cuda._sleep(500_000_000)
        t = time.perf_counter(); fn(); dt = time.perf_counter() - t
    s.synchronize()
    print(f"{name}: host blocked {dt*1e3:.1f} ms")
