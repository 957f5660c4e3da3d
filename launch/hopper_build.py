"""The ``hopper`` extra's kernels built in a child process while the first calls run without them
(``vpce.backends.hopper``), seen from one fresh process on an sm_90 GPU with the extra installed.

With an empty ``QUACK_CACHE_DIR`` of its own, it runs two fwd+bwd on the Llama-3-8B head (the default route: the
child is compiling), waits for the kernels (``vpce.build_hopper_kernels``), then runs steps on the extra (plain,
soft-capped, label smoothing), printing each step's wall time and the route's ``routing.Extra``. It compares the
first step's loss and gradients with the extra's, and the compiled objects in the cache before and after the steps
on the extra (the child's, untouched: the GPU process found each kernel under the child's key).

    python launch/hopper_build.py [--shape 16384x4096x128256]
"""

import argparse
import pathlib
import tempfile
import time
import os

LAUNCHED = time.time()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="16384x4096x128256", help="NxDxV")
    args = ap.parse_args(argv)
    cache = pathlib.Path(tempfile.mkdtemp(prefix="vpce-quack-cache-"))
    os.environ["QUACK_CACHE_DIR"] = str(cache)  # before quack is imported (by the child, then here)
    import torch

    import vpce
    from vpce import routing

    if not torch.cuda.is_available():
        ap.error("expected an sm_90 GPU, got no CUDA device")
    n, d, v = (int(t) for t in args.shape.split("x"))
    torch.manual_seed(0)
    x = torch.randn(n, d, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.randn(v, d, device="cuda") / d**0.5).to(torch.bfloat16).requires_grad_()
    y = torch.randint(0, v, (n,), device="cuda")
    seen = []
    asked = routing.extra_facts

    def spy(h, wt):
        seen.append(asked(h, wt))
        return seen[-1]
    routing.extra_facts = spy

    def step(label, **kw):
        x.grad = w.grad = None
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = vpce.linear_cross_entropy(x, w, y, **kw)
        loss.backward()
        torch.cuda.synchronize()
        print(f"{label}: {time.perf_counter() - t0:.3f} s, {seen[-1] if seen else None}, loss {loss.item():.6f}",
              flush=True)
        return loss.detach(), x.grad.clone(), w.grad.clone()

    first = step("first")
    step("second")
    objects = lambda: sorted((o.name, o.stat().st_mtime_ns) for o in cache.rglob("*.o"))  # noqa: E731
    t0 = time.perf_counter()
    ok = vpce.build_hopper_kernels()
    print(f"build_hopper_kernels: {time.perf_counter() - t0:.2f} s, ready={ok}, {time.time() - LAUNCHED:.1f} s after "
          f"launch; {len(objects())} compiled objects", flush=True)
    before = objects()
    extra = step("first on the extra")
    step("next on the extra")
    step("soft-capped", softcap=30.0)
    step("label smoothing", label_smoothing=0.1)
    after = objects()
    kept = all(o in after for o in before)
    print(f"the child's objects untouched by this process: {kept} ({len(before)} at ready, {len(after)} after)")
    for name, i in (("loss", 0), ("dX", 1), ("dW", 2)):
        r = ((first[i].float() - extra[i].float()).norm() / extra[i].float().norm()).item()
        print(f"{name}: default route vs the extra, relative difference {r:.2e}")
    return 0 if ok and kept else 1


if __name__ == "__main__":
    raise SystemExit(main())
