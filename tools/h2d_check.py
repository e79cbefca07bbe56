"""Does a non-blocking host-to-device copy make the host wait for the device? From pageable memory and from pinned
memory, each issued behind about 50 ms of queued GPU work (``torch.cuda._sleep``): the time the copy call itself
takes on the host (the engine loop issues one such copy per step before the step's graph replay).

    python tools/h2d_check.py
"""

import time

import torch


def main() -> None:
    from gpu_only import require

    require("tools/h2d_check.py", modules=())
    dev = torch.device("cuda")
    dst = torch.empty(64, dtype=torch.int64, device=dev)
    host = torch.arange(64)
    for _ in range(2):  # the first round warms up the allocator and the driver
        for name, src in (("pageable", host), ("pinned", host.pin_memory())):
            torch.cuda.synchronize()
            t = time.perf_counter()
            torch.cuda._sleep(100_000_000)
            queued = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            copied = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            print(f"{name:>8}: copy call {1e3 * (copied - queued):7.3f} ms, the queued work took "
                  f"{1e3 * (done - t):7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
