"""Run decode_model_cpu.py with rope.angle_tables memoized across layers (prototype: held, never dropped)."""
import sys, runpy
sys.path.insert(0, "/work/main")
import veloxquant_mlx  # noqa
from veloxquant_mlx.cache.primitives import rope
orig = rope.angle_tables
memo = {}
def tables(omega, offset, n):
    if not isinstance(offset, int):
        return orig(omega, offset, n)
    key = (id(omega), offset, n)
    hit = memo.get(key)
    if hit is None:
        if len(memo) >= 4:
            memo.pop(next(iter(memo)))
        hit = memo[key] = orig(omega, offset, n)
    return hit
rope.angle_tables = tables
sys.argv = ["decode_model_cpu.py"] + sys.argv[1:]
runpy.run_path("/work/main/scripts/decode_model_cpu.py", run_name="__main__")
