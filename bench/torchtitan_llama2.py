"""torchtitan's `torchtitan.train`, unmodified, with Llama 2 13B and 70B among its llama3 flavors.

    torchrun ... bench/torchtitan_llama2.py --model.name llama3 --model.flavor llama2_13B ...

torchtitan's docs/performance.md (mid-2024) gives Llama 2 13B and 70B rows (docs/validation.md,
E28-E32), run with the llama2 model torchtitan had then. torchtitan 0.2.2 has only llama3, whose
model is the same architecture (RMSNorm, RoPE, SwiGLU, grouped-query attention where n_kv_heads
is set): Llama 2's shapes are its arguments (Touvron et al. 2023, Table 1 and the released
params.json: vocabulary 32000, RoPE theta 10000, FFN 13824 and 28672). So this registers them
as two more flavors of torchtitan's own llama3 model registry and runs torchtitan's trainer as
`python -m torchtitan.train` would; nothing of torchtitan is changed.
"""

import runpy

from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

llama3_args["llama2_13B"] = TransformerModelArgs(dim=5120, n_layers=40, n_heads=40, vocab_size=32000,
                                                 multiple_of=256, rope_theta=10000)
llama3_args["llama2_70B"] = TransformerModelArgs(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                                                 ffn_dim_multiplier=1.3, multiple_of=4096, rope_theta=10000)

if __name__ == "__main__":
    runpy.run_module("torchtitan.train", run_name="__main__", alter_sys=True)
