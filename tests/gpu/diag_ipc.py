"""Which torch ops on CUDA IPC memory (cudaIpcOpenMemHandle, as the device
slab and answer are mapped; the runtime takes only the flag
cudaIpcMemLazyEnablePeerAccess) block the host? A child process exports a
buffer; this process maps it (flags 0 and LazyEnablePeerAccess), views it
through DLPack and __cuda_array_interface__, and times each op queued
behind a ~150 ms kernel on a side stream (0.x ms: asynchronous). Seen on
torch 2.11 + H100: only the first launch of each kernel in the process
blocks (CUDA lazy module loading), whichever view comes first; with
CUDA_MODULE_LOADING=EAGER nothing does."""
import multiprocessing as mp
import time

N = 1 << 20


def exporter(q, done):
    import cupy
    from cupy.cuda import runtime as rt
    p = rt.malloc(4 * N)
    cupy.cuda.Device(0).synchronize()
    q.put(bytes(rt.ipcGetMemHandle(p)))
    done.wait()


class CAI:
    def __init__(s, p, n):
        s.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (p, False),
                                      "version": 3, "strides": None, "stream": None}


def main():
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=exporter, args=(q, done))
    child.start()
    h = q.get()
    try:
        run(h)
    finally:
        done.set()
        child.join()


def run(h):
    import cupy
    import torch
    from cupy.cuda import runtime as rt
    x = torch.rand(N, device="cuda")
    s = torch.cuda.Stream()
    for flags in (rt.cudaIpcMemLazyEnablePeerAccess,):
        p = rt.ipcOpenMemHandle(h, flags)
        mem = cupy.cuda.UnownedMemory(p, 4 * N, None, 0)
        views = {"dlpack": torch.from_dlpack(cupy.ndarray((N,), cupy.float32,
                                                          cupy.cuda.MemoryPointer(mem, 0))),
                 "cai": torch.as_tensor(CAI(p, N), device="cuda")}
        for vn, v in views.items():
            for name, fn in [("kernel writes (torch.maximum(x, x, out=v))",
                              lambda: torch.maximum(x, x, out=v)),
                             ("kernel reads (x * v -> new)", lambda: x * v),
                             ("copy into (v.copy_(x))", lambda: v.copy_(x)),
                             ("copy out (x.copy_(v))", lambda: x.copy_(v))]:
                torch.cuda.synchronize()
                with torch.cuda.stream(s):
                    torch.cuda._sleep(300_000_000)
                    t0 = time.perf_counter()
                    fn()
                    dt = time.perf_counter() - t0
                s.synchronize()
                print(f"ipc flags={flags} {vn:6s} {name:45s} host blocked {dt * 1e3:7.1f} ms")
        del views
        torch.cuda.synchronize()
        rt.ipcCloseMemHandle(p)


if __name__ == "__main__":
    main()
