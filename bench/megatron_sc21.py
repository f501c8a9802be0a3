"""End-to-end case for clocked mode's validation: a row of Megatron's SC'21 paper (Narayanan et
al., "Efficient Large-Scale Language Model Training on GPU Clusters Using Megatron-LM", Table 1),
configured as the paper's own scripts ran it, on unmodified megatron-core 0.16.1.

    torchrun --nproc_per_node=8 bench/megatron_sc21.py --size 1.7B

The configuration is Megatron-LM's examples/sc21 (commit de7dc40f88, August 2021): run_table_1.sh
gives each size's tensor parallelism, micro-batch, global batch, layers, hidden size and heads;
CONFIG.sh the rest: sequence 2048, fp16 with a static loss scale of 8192, gradient clipping 1.0,
`--checkpoint-activations` (every layer recomputed in the backward), `--DDP-impl torch`, GPT-2's
BPE vocabulary (50,257 tokens, padded by Megatron to a multiple of 128 x TP), and Megatron's
defaults of the time: dropout 0.1 on attention probabilities and hidden states, 4h MLPs with
GELU, learned absolute positions, tied input and output embeddings, Adam with weight decay 0.01
on fp32 main parameters, and the fused causal softmax kernel.

What runs is megatron-core's GPTModel with its local layer spec (no Transformer Engine), its
Float16Module, its DistributedDataParallel (fp16 gradients reduced in buckets overlapped with the
last micro-batch's backward, as torch's DDP did) and its fp16 optimizer, driven by its
no-pipelining schedule, data parallel over what tensor parallelism leaves. The linear layers
have biases, placed as 2021's were: the QKV projection's added after its GEMM, the others fused
into bias + GeLU and into bias + dropout + residual add. Where this differs from 2021's
Megatron-LM (each difference does more work than 2021's):
- the fused softmax is Megatron's CUDA extension, which cannot be built without nvcc; under
  mirage bench/megatron_extensions/ provides it, each call timed as the one kernel it is;
- the bias fusions were TorchScript's in 2021 and are torch.compile's in megatron-core, whose
  host kernels would make a predict-only step of these sizes take hours here: under mirage
  bench/megatron_extensions/jit_fusions.py runs each as its Python original timed as the one
  kernel a fuser makes of it;
- Adam is torch's fused AdamW (apex's FusedAdam, its 2021 equivalent, is not installed), and
  megatron-core's multi-tensor copies, scaling and norms without apex are per-tensor kernels.

Prints one JSON line from global rank 0: the median step time its CUDA events measured (steps
after the first) and the tokens per second per GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

# run_table_1.sh: tensor parallel size, micro-batch, global batch, layers, hidden size, heads.
SIZES = {
    "1.7B": (1, 16, 512, 24, 2304, 24),
    "3.6B": (2, 16, 512, 30, 3072, 32),
    "7.5B": (4, 16, 512, 36, 4096, 32),
    "18B": (8, 8, 1024, 40, 6144, 48),
}
GPT2_VOCAB = 50257
SEQ = 2048


def padded_vocab(tp: int) -> int:
    """Megatron's --make-vocab-size-divisible-by 128, per tensor-parallel rank."""
    multiple = 128 * tp
    return -(-GPT2_VOCAB // multiple) * multiple


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=SIZES, required=True, help="a row of Table 1")
    ap.add_argument("--data-parallel", type=int, default=32,
                    help="the run's data-parallel size, which sets the accumulation (Table 1's rows: 32)")
    ap.add_argument("--steps", type=int, default=2)
    args = ap.parse_args()
    under_mirage = bool(os.environ.get("MIRAGE_SESSION"))
    if under_mirage:  # the fused softmax extension (after any installed one) and the bias fusions
        sys.path.append(str(Path(__file__).with_name("megatron_extensions")))

    import torch
    import torch.distributed as dist

    try:
        import megatron.core  # noqa: F401
    except ImportError:  # where tests/test_megatron.py installs it
        installed = Path(__file__).resolve().parent.parent / ".venv-megatron"
        if not (installed / "megatron" / "core").is_dir():
            raise SystemExit("megatron_sc21: megatron-core is not installed; install it beside torch with "
                             "`python -m pip install --no-deps --target .venv-megatron megatron-core==0.16.1`")
        sys.path.insert(0, str(installed))
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer.module import Float16Module
    from megatron.core.transformer.transformer_config import TransformerConfig
    if under_mirage:
        import jit_fusions  # bench/megatron_extensions/jit_fusions.py
        jit_fusions.install()

    tp, micro_batch, global_batch, layers, hidden, heads = SIZES[args.size]
    accumulate = global_batch // (micro_batch * args.data_parallel)
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl")
    if dist.get_world_size() != tp * args.data_parallel:
        raise SystemExit(f"megatron_sc21: {args.size} runs TP {tp} x DP {args.data_parallel} = "
                         f"{tp * args.data_parallel} GPUs, not {dist.get_world_size()}")
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, create_gloo_process_groups=False)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)

    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, ffn_hidden_size=4 * hidden,
        tensor_model_parallel_size=tp, hidden_dropout=0.1, attention_dropout=0.1, init_method_std=0.02,
        fp16=True, params_dtype=torch.half, pipeline_dtype=torch.half, attention_softmax_in_fp32=False,
        masked_softmax_fusion=True, add_bias_linear=True, bias_activation_fusion=True, bias_dropout_fusion=True,
        gradient_accumulation_fusion=False, recompute_granularity="full", recompute_method="uniform",
        recompute_num_layers=1)
    model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=padded_vocab(tp), max_sequence_length=SEQ,
                     position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True).cuda()
    model = Float16Module(config, model)
    model = DistributedDataParallel(config=config, module=model, ddp_config=DistributedDataParallelConfig(
        grad_reduce_in_fp32=False, overlap_grad_reduce=True, use_distributed_optimizer=False))
    config.no_sync_func = model.no_sync  # as Megatron's training loop wires its schedule
    config.finalize_model_grads_func = finalize_model_grads
    optimizer = get_megatron_optimizer(OptimizerConfig(
        optimizer="adam", lr=1e-4, weight_decay=0.01, fp16=True, loss_scale=8192.0, clip_grad=1.0,
        params_dtype=torch.half, use_distributed_optimizer=False), [model],
        use_gloo_process_groups=False)
    # Without apex, megatron-core falls back to torch's AdamW (its comment: apex's FusedAdam is a
    # drop-in replacement); 2021 stepped with apex's FusedAdam, one fused multi-tensor kernel per
    # group, which is what torch's fused implementation is.
    for group in optimizer.optimizer.param_groups:
        group.update(fused=True, foreach=False)

    tokens = torch.randint(0, GPT2_VOCAB, (micro_batch, SEQ + 1), device="cuda")
    positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(micro_batch, -1)

    def forward_step(data_iterator, model):
        output = model(tokens[:, :-1], positions, None, labels=tokens[:, 1:])

        def loss(per_token):
            value = per_token.float().mean()
            return value, {"loss": value.detach()}

        return output, loss

    times = []
    for _ in range(args.steps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        get_forward_backward_func()(forward_step_func=forward_step, data_iterator=None, model=[model],
                                    num_microbatches=accumulate, seq_length=SEQ, micro_batch_size=micro_batch,
                                    forward_only=False)
        optimizer.step()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    step_ms = statistics.median(times[1:] if len(times) > 1 else times)
    if dist.get_rank() == 0:
        tokens_per_gpu = micro_batch * accumulate * SEQ / tp  # a tensor-parallel group shares its micro-batches
        print("E2E " + json.dumps({"step_ms": step_ms, "tokens_per_s_per_gpu": tokens_per_gpu / (step_ms / 1e3)}))
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
