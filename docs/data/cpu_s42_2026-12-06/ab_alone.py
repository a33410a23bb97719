import sys, statistics, time
sys.path.insert(0, 'scripts'); sys.path.insert(0, '.')
from veloxquant_mlx import _blas; _blas.preload()
import mlx.core as mx
from cpu_streams_ab import make
from veloxquant_mlx.cache import attention, dispatch, grouped
T = int(sys.argv[1]); rounds = int(sys.argv[2]); methods = sys.argv[3:] or ["kivi"]
H, R, D, S = 3, 3, 64, 16
dispatch.install()
k, v, q = (mx.random.normal((1, h, T + S, D), key=mx.random.key(i)) for i, h in enumerate((H, H, H * R)))
mx.eval(k, v, q)
caches = {m: make(m, D) for m in ["plain"] + methods}
for c in caches.values():
    for s in range(0, T, 512):
        K, V = c.update_and_fetch(k[:, :, s:s + 512], v[:, :, s:s + 512])
        mx.eval(dispatch.dispatched_sdpa(q[:, :, s:s + 512], K, V, cache=c, scale=D**-0.5, mask="causal"))
real = grouped.GroupedQuantCache._codes_alone
res = {}
for _ in range(rounds):
    for name, c in caches.items():
        for mode in (("one",) if name == "plain" else ("parts", "alone")):
            grouped.GroupedQuantCache._codes_alone = real if mode == "alone" else (lambda self, qf, n: None)
            times = []
            for i in range(T, T + S):
                t0 = time.perf_counter()
                K, V = c.update_and_fetch(k[:, :, i:i + 1], v[:, :, i:i + 1])
                out = dispatch.dispatched_sdpa(q[:, :, i:i + 1], K, V, cache=c, scale=D**-0.5, mask=None)
                del K, V
                mx.eval(out)
                times.append(time.perf_counter() - t0)
            c.trim(S)
            res.setdefault((name, mode), []).append(statistics.median(times) * 1e3)
for (name, mode), xs in res.items():
    print(f"{name:10s} {mode:6s} {statistics.median(xs):7.3f} ms  rounds " + " ".join(f"{x:.2f}" for x in xs))
