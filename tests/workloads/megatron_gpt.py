"""Megatron-core 0.16.1, unmodified, trains a small GPT on emulated GPUs: its local layer spec
(no Transformer Engine), its tensor and pipeline parallelism, its DistributedDataParallel with
the distributed optimizer, and its 1F1B schedule (get_forward_backward_func). Launched with
`--nproc-per-node N`; TP and PP from the environment (MEGATRON_TP, MEGATRON_PP), data parallel
the rest. The last pipeline stage's rank 0 prints `loss <first> -> <last> over <steps> steps`.
"""

import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt.gpt_model import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.transformer.transformer_config import TransformerConfig

TP, PP = int(os.environ.get("MEGATRON_TP", "2")), int(os.environ.get("MEGATRON_PP", "2"))
STEPS, MICRO_BATCHES, MICRO_BATCH, SEQ, VOCAB = int(os.environ.get("STEPS", "8")), 4, 2, 64, 256

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP, pipeline_model_parallel_size=PP)
tensor_parallel.model_parallel_cuda_manual_seed(1234)

config = TransformerConfig(num_layers=4, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True,
                           pipeline_dtype=torch.float32, params_dtype=torch.float32)
model = GPTModel(config=config, transformer_layer_spec=get_gpt_layer_local_spec(), vocab_size=VOCAB,
                 max_sequence_length=SEQ, pre_process=parallel_state.is_pipeline_first_stage(),
                 post_process=parallel_state.is_pipeline_last_stage()).cuda()
ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                           use_distributed_optimizer=True)
model = DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)
optimizer = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=3e-3, use_distributed_optimizer=True),
                                   [model])

# A learnable task: each sequence counts up from a random start (next token = this one + 1).
generator = torch.Generator().manual_seed(parallel_state.get_data_parallel_rank())


def batches():
    while True:
        start = torch.randint(0, VOCAB, (MICRO_BATCH, 1), generator=generator)
        tokens = (start + torch.arange(SEQ + 1)) % VOCAB
        yield {"tokens": tokens[:, :-1].cuda(), "labels": tokens[:, 1:].cuda()}


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    positions = torch.arange(SEQ, device="cuda").unsqueeze(0).expand(MICRO_BATCH, -1)
    mask = torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool, device="cuda").tril().logical_not()
    output = model(batch["tokens"], positions, mask, labels=batch["labels"])

    def loss(output_tensor):
        value = output_tensor.float().mean()
        return value, {"loss": value.detach().clone()}  # the schedule scales `value` in place

    return output, loss


data = batches()
losses = []
for step in range(STEPS):
    model.zero_grad_buffer()
    optimizer.zero_grad()
    results = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=data, model=model,
                                          num_microbatches=MICRO_BATCHES, seq_length=SEQ,
                                          micro_batch_size=MICRO_BATCH, forward_only=False)
    succeeded, _, _ = optimizer.step()
    assert succeeded
    if parallel_state.is_pipeline_last_stage():
        losses.append(torch.stack([r["loss"] for r in results]).mean().item())
if parallel_state.is_pipeline_last_stage() and parallel_state.get_tensor_model_parallel_rank() == 0 \
        and parallel_state.get_data_parallel_rank() == 0:
    print(f"TP {TP} x PP {PP} x DP {parallel_state.get_data_parallel_world_size()} losses",
          " ".join(f"{loss:.5f}" for loss in losses), flush=True)
parallel_state.destroy_model_parallel()
dist.destroy_process_group()
