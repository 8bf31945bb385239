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
# 64 MiB a call carries), then `bench latency` on CUDA (bf16, dense) and on the CPU for scale, on a
# random-weight model of the default model's shape (SmolLM2-135M: 30 layers, 576 wide, 9 / 3 heads).
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="llguidance jsonschema jsonschema-specifications referencing rpds-py gguf"

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

timeout 240 python3 -m pytest -q -rA -p no:cacheprovider tests/test_devices.py 2>&1 | tee "$out/test_devices.log"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

python3 - "$out/model" <<'EOF' 2>&1 | tee "$out/model.log"
import sys
from tiny_models import make_hf_model
# The default model's shape (SmolLM2-135M), random weights: speed only.
make_hf_model("llama", sys.argv[1], overrides=dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                                   num_attention_heads=9, num_key_value_heads=3, head_dim=64,
                                                   max_position_embeddings=2048))
print("model written")
EOF
for device in cuda cpu; do
    timeout 150 python3 -m tokenmill.cli bench latency --model "$out/model" --device "$device" --no-peer \
        --output "$out/latency-$device.json" 2>&1 | tee "$out/latency-$device.log"
    [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
done
rm -rf "$out/model"
echo "cuda-check: status $status"
exit $status
