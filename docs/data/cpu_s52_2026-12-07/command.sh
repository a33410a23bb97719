# Session 52 (2026-12-07), this project's 2-core x86-64 CPU machine, SmolLM2-135M's shape, float32.
# adakv_4k_before_after.txt: the whole model at 4k, the tree before AdaKV's kernel (910efc4, a git worktree at
# /tmp/wt_before) and after it, alternated, two pairs (the machine was noisy: plain 4.1-7.2 tok/s):
for r in 1 2; do for t in /tmp/wt_before .; do (cd $t && OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py \
  --context 4096 --steps 8 --rounds 3 --method adakv); done; done
# one layer at 8k, printed only (before ~18-21 ms against a plain cache at 3.7-5.1 ms; after 4.0-5.1 against 4.1-4.9):
python scripts/decode_step_cpu.py --context 8192 --method adakv
# anchorkv_4k_before_after.txt: likewise for AnchorKV on KIVI's CPU kernel (its anchors as corrections over key rows):
for r in 1 2; do for t in /tmp/wt_before .; do (cd $t && OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py \
  --context 4096 --steps 8 --rounds 3 --method anchorkv); done; done
# one layer at 8k, printed only (before 18.2 ms against a plain cache at 3.8 ms; after 4.3 against 4.7):
python scripts/decode_step_cpu.py --context 8192 --method anchorkv
# anchorkv_4k_refs.txt: after the kernel reads AnchorKV's references and anchor rows itself (fix_refs), two runs:
for r in 1 2; do OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 \
  --method anchorkv; done
# drop_row_2k_before_after.txt: TOVA's and MorphKV's one-row drop in one CPU primitive, the tree before (910efc4) and
# after, one pair:
for t in /tmp/wt_before .; do (cd $t && OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 2048 \
  --steps 8 --rounds 3 --method morphkv --method tova); done
