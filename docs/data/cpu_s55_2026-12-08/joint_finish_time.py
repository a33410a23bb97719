# One layer's joint_finish over 4096 float16 rows (3 KV heads, 3 query rows each) against MLX's fused attention over
# the same rows in float32; run from the repository root: OPENBLAS_THREAD_TIMEOUT=4 python <this file>
import time, numpy as np, mlx.core as mx
from veloxquant_mlx.cache import native
from veloxquant_mlx.cache.window import Partials, finish_partials, scaled_rows
B,H,R,D,T = 1,3,3,64,4096
rng = np.random.default_rng(0)
k = mx.array(rng.normal(size=(B,H,T+512,D)).astype(np.float16)); v = mx.array(rng.normal(size=(B,H,T+512,D)).astype(np.float16))
q = mx.array(rng.normal(size=(B,H*R,1,D)).astype(np.float32))
kv = (k[:, :, :T], v[:, :, :T])
def f():
    qf = scaled_rows(q, H, 0.125)
    return finish_partials(q, qf, Partials.empty(B,H,R,D), [kv], None)
mx.eval(f())
ts=[]
for _ in range(5):
    t=time.perf_counter()
    for _ in range(50): mx.eval(f())
    ts.append((time.perf_counter()-t)/50*1e3)
print("joint_finish 4k f16 ms: median %.3f min %.3f" % (sorted(ts)[2], min(ts)))
kf = k[:, :, :T].astype(mx.float32); vf = v[:, :, :T].astype(mx.float32); mx.eval(kf, vf)
ts=[]
for _ in range(5):
    t=time.perf_counter()
    for _ in range(50): mx.eval(mx.fast.scaled_dot_product_attention(q, kf, vf, scale=0.125))
    ts.append((time.perf_counter()-t)/50*1e3)
print("mlx sdpa 4k f32 ms: median %.3f min %.3f" % (sorted(ts)[2], min(ts)))
print(float(mx.abs(f() - mx.fast.scaled_dot_product_attention(q, kf, vf, scale=0.125)).max()))
