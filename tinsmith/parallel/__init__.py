"""Tensor parallelism: one process per device, one shard of every large weight per process.

The worker becomes a process group (torch.distributed: NCCL on GPUs, gloo on CPUs). Each rank
loads the checkpoint and keeps its slice of the weights (Megatron-style column / row parallel
projections, a vocabulary-parallel embedding and LM head); LoRA adapters are sharded the S-LoRA
way. See docs/parallel.md for what exists and what does not yet.
"""

from tinsmith.parallel.group import ParallelError, TPGroup, init_tp_group

__all__ = ["ParallelError", "TPGroup", "init_tp_group"]
