"""Random-weight GGUF files of each model family in a realistic shape, for `tokenmill bench compare`
(speed only: the weights are random). Built with the tests' converter (tests/tiny_models.py), which
writes what llama.cpp's convert_hf_to_gguf.py writes.

    .venv/bin/python scripts/make-family-ggufs.py [OUT_DIR] [--ftype Q4_0] [--kinds gemma2 phi3 ...]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from tiny_models import hf_to_gguf, make_hf_model  # noqa: E402

# Shapes of the families' small members, scaled to ~100-300M parameters so that a 2-core machine
# builds and runs them in minutes; head dims, GQA ratios and expert counts are the real ones'.
SHAPES = {
    "gemma2": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                   num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                   max_position_embeddings=4096, vocab_size=32768),
    "phi3": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                 num_key_value_heads=16, max_position_embeddings=4096, original_max_position_embeddings=4096,
                 sliding_window=2047, vocab_size=32064,
                 rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                  "short_factor": [1.0] * 32, "long_factor": [4.0] * 32}),
    "mixtral": dict(hidden_size=1024, intermediate_size=1408, num_hidden_layers=12, num_attention_heads=16,
                    num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
                    max_position_embeddings=4096, vocab_size=32000),
    "qwen3_moe": dict(hidden_size=1024, intermediate_size=3072, moe_intermediate_size=256, num_hidden_layers=12,
                      num_attention_heads=16, num_key_value_heads=4, head_dim=128, num_experts=64,
                      num_experts_per_tok=8, max_position_embeddings=4096, vocab_size=32000),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", nargs="?", default="bench-models")
    parser.add_argument("--ftype", default="Q4_0")
    parser.add_argument("--kinds", nargs="*", default=list(SHAPES), choices=list(SHAPES))
    args = parser.parse_args()
    out = Path(args.out)
    for kind in args.kinds:
        with tempfile.TemporaryDirectory() as tmp:
            # general.name is the folder's: one that says "phi3" makes llama.cpp adjust Phi-3's own
            # special tokens, which the tests' tokenizer lacks
            name = f"bench-{kind.replace('phi3', 'phi')}"
            folder = make_hf_model(kind, Path(tmp) / name, overrides=SHAPES[kind])
            path = hf_to_gguf(folder, out / f"bench-{kind}-{args.ftype}.gguf", args.ftype)
        print(path, f"{path.stat().st_size / 2**20:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()
