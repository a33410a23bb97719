# MiniCache's decode at 4k on the 2-core CPU, before (823f6ba) and after (raw blocks read in place), alternated.
# before: git worktree add /tmp/wt_before 823f6ba; each run from its tree's root with the main checkout's .venv
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method minicache
# A2ATS (a2ats_*): before 7c9a14c... the same tree as MiniCache's "after" (6ab9998's A2ATS), after = this commit
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method a2ats
# A2ATS's vote (a2ats_vote_*): before = 10ce2c9 (joint_finish step), after = the vq_vote commit
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method a2ats
# XQuant (xquant_4k_*): before = 2c82d8a, after = the xquant commit
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method xquant
# every method at 2k, one round, a ranking only (alldec_2048.txt; xquant's row is before its change)
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --shape smollm2 --context 2048 --steps 8 --rounds 1 --prefill --all
# RocketKV (rocketkv_4k_*): before = e465d09, after = the rocketkv commits; caches filled through the model (--prefill):
# filled directly, the before tree fails (a pending eviction's rows; fixed in the second rocketkv commit)
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --prefill --method rocketkv
# joint_finish's float16 rows 8 at a time (minicache_f16c_4k_*): before = aafa188, after = the joint_finish commit
OPENBLAS_THREAD_TIMEOUT=4 python scripts/decode_model_cpu.py --context 4096 --steps 8 --rounds 3 --method minicache
