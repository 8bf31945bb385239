"""Part of scripts/cuda-check.sh: decode steps on the device, wall time per step at batch 1, 8 and 32,
and a torch.profiler table of batch-1 decode steps (where the time goes: kernels vs host work between
them). Usage: cuda-profile.py MODEL_DIR DEVICE"""
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from tokenmill import LLM, SamplingParams

path, device = sys.argv[1], sys.argv[2]
llm = LLM(path, device=device, num_kv_blocks=2048)
eng = llm.engine
params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)


def steps(batch: int, n: int) -> float:
    requests = [eng.add_request([5 + (i + j) % 300 for j in range(32)], params) for i in range(batch)]
    for _ in range(8):       # prefill and warm-up
        eng.step()
    sync()
    t = time.perf_counter()
    for _ in range(n):
        eng.step()
    sync()
    per = (time.perf_counter() - t) / n
    for request in requests:   # (not run to their 400 tokens: the time is measured)
        eng.abort(request.request_id)
    return per


for batch in (1, 8, 32):
    per = steps(batch, 40)
    print(f"batch {batch:3d}: {per * 1e3:7.2f} ms/step  {batch / per:8.1f} tok/s", flush=True)

eng.add_request(list(range(5, 37)), params)
for _ in range(8):
    eng.step()
acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
with profile(activities=acts) as prof:
    for _ in range(20):
        eng.step()
    sync()
key = "self_cuda_time_total" if device.startswith("cuda") else "self_cpu_time_total"
print(prof.key_averages().table(sort_by=key, row_limit=30, max_name_column_width=60))
print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=30, max_name_column_width=60))
