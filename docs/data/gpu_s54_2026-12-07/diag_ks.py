"""Session 54 diagnostic (untracked): KIVI-sink's CUDA decode kernel giving zeros with blocks.on_cpu patched True."""
import sys
sys.path.insert(0, "tests")
import mlx.core as mx
from veloxquant_mlx.cache import dispatch, native
from veloxquant_mlx.cache.primitives import blocks
from veloxquant_mlx.cache.kernels import _common
from contract_table import make, rand, sdpa

native._ENV_ON = False
B, H, Hq, D, scale = 1, 2, 6, 64, 0.125
real_on_cpu = blocks.on_cpu
for method in sys.argv[1:] or ["kivi_sink", "kivi"]:
    ref = None
    for patch in (False, True, False, True, None):
        blocks.on_cpu = real_on_cpu if patch is None else (lambda p=patch: p)
        mx.random.seed(3)
        cache = make(method)
        K, V = cache.update_and_fetch(rand(B, H, 300, D), rand(B, H, 300, D))
        mx.eval(dispatch.dispatched_sdpa(rand(B, Hq, 300, D), K, V, cache=cache, scale=scale, mask="causal"))
        cache.update_and_fetch(rand(B, H, 40, D), rand(B, H, 40, D))
        got, dense = [], []
        for _ in range(3):
            K, V = cache.update_and_fetch(rand(B, H, 1, D), rand(B, H, 1, D))
            q = rand(B, Hq, 1, D)
            got.append(dispatch.dispatched_sdpa(q, K, V, cache=cache, scale=scale, mask=None))
            dense.append(sdpa(q, K, V, None, scale))
        mx.eval(got, dense)
        mx_ = [float(mx.abs(g).max()) for g in got]
        err = [float(mx.abs(g - d).max()) for g, d in zip(got, dense)]
        vs = [float(mx.abs(g - r).max()) for g, r in zip(got, ref)] if ref else None
        ref = ref or got
        print(method, "on_cpu", patch, "max|out|", ["%.3g" % x for x in mx_], "vs dense", ["%.2g" % x for x in err],
              "vs first", vs, "n_quant", cache.n_quant, "offset", cache.offset, type(K).__name__, K.shape,
              "checked", sorted(_common._checked), "disabled", sorted(_common._disabled), flush=True)
