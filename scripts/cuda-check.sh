#!/usr/bin/env bash
# The CUDA check, prepared to run in one go when a task is lent a GPU machine (device time is
# short and the machine is offline). Its image has Python 3.12 with torch, transformers,
# tokenizers, safetensors, numpy, jinja2, pytest and hypothesis, but not the rest of what
# tokenmill imports, which travels as wheels:
#
#   here:   bash scripts/cuda-check.sh fetch    # those wheels into .whl/ (git-ignored through
#                                               # .git/info/exclude); then the device tool's run with
#   there:  bash scripts/cuda-check.sh run      # carry [".whl"]; results under $OUT (else cuda-check/)
#
# `run`: the wheels into /tmp/site, tokenmill from src/ (no install), nvidia-smi and torch's view of
# the GPU, tests/test_devices.py (its default-model case skips there: the 98 MB GGUF does not fit the
# 64 MiB a call carries); then, on a random-weight model of the default model's shape (SmolLM2-135M:
# 30 layers, 576 wide, 9 / 3 heads), scripts/cuda-profile.py (decode steps per second at batch 1, 8
# and 32, and a profiler table), `bench latency` and `bench throughput` on CUDA against transformers
# on the same GPU; then the engine-level test suites with the GPU as their default device. Each step
# has its own timeout; all of them fit a call's 10 minutes (about 6 minutes on an H200).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="llguidance jsonschema jsonschema-specifications referencing rpds-py gguf"
SUITES="tests/test_engine.py tests/test_paged_engine.py tests/test_families.py tests/test_moe.py tests/test_speculative.py
        tests/test_structured.py tests/test_sampling.py tests/test_tiny_models.py tests/test_model_parity.py
        tests/test_rope.py tests/test_kv_cache.py tests/test_llm.py tests/test_gguf_checkpoint.py tests/test_tool_calls.py
        tests/test_isolation.py tests/test_config.py"

if [ "${1:-}" = "fetch" ]; then
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    mkdir -p .whl
    rm -f .whl/*.whl
    for name in $WHEELS; do   # the versions this checkout's .venv runs (scripts/install.sh)
        version=$(.venv/bin/python -m pip show "$name" | sed -n 's/^Version: //p')
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
            --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 \
            --platform manylinux_2_34_x86_64 --platform manylinux2014_x86_64 \
            --platform any -d .whl "$name==$version" || exit 1
    done
    du -sh .whl && ls .whl
    exit 0
fi
[ "${1:-}" = "run" ] || { echo "usage: $0 fetch | run" >&2; exit 2; }

out="${OUT:-cuda-check}"
mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
export PYTHONPATH="$PWD/src:$PWD/tests:/tmp/site" PYTHONUNBUFFERED=1
status=0
{
    nvidia-smi
    python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(),
        torch.cuda.get_device_name(0) if torch.cuda.is_available() else '-')"
} > "$out/gpu.txt" 2>&1
cat "$out/gpu.txt"

timeout 50 python3 -m pytest -q -rA -p no:cacheprovider -k "not cpu" tests/test_devices.py 2>&1 | tee "$out/test_devices.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

python3 - "$out/model" <<'EOF' 2>&1
import sys
from tiny_models import make_hf_model
# The default model's shape (SmolLM2-135M), random weights: speed only.
make_hf_model("llama", sys.argv[1], overrides=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                                   max_position_embeddings=2048))
print("model written")
EOF
timeout 90 python3 scripts/cuda-profile.py "$out/model" cuda > "$out/profile.txt" 2>&1
[ $? -eq 0 ] || status=1
head -4 "$out/profile.txt"
for bench in latency throughput; do   # against transformers on the same GPU
    extra=(); [ "$bench" = throughput ] && extra=(--skip-ablations --num-requests 32 --max-num-seqs 32 --hf-batch-size 32)
    timeout 90 python3 -m tokenmill.cli bench "$bench" --model "$out/model" --device cuda "${extra[@]}" \
        --output "$out/$bench-cuda.json" > "$out/$bench-cuda.log" 2>&1
    [ $? -eq 0 ] || status=1
    grep -v "it/s" "$out/$bench-cuda.log" | tail -12
done
rm -rf "$out/model"

# The engine-level suites on CUDA: their engines take the default device ("auto"), which is the GPU
# there. The C kernels are compiled once before the workers start. -v: each test's outcome is logged as
# it ends, so a run cut short by the timeout still names its failures.
python3 -c "from tokenmill import kernels; kernels.load()"
timeout 200 python3 -m pytest -v -rfE --tb=short -p no:cacheprovider -n 14 --timeout 60 $SUITES > "$out/suite.log" 2>&1
echo "suite: exit $?"; grep -E "^(FAILED|ERROR)" "$out/suite.log" | head -20; tail -2 "$out/suite.log"
echo "cuda-check: status $status"
exit $status
