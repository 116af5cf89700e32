"""Data-parallel training across processes on torch.distributed (``--distributed``).

Launched with one process per device by torchrun::

    torchrun --nproc_per_node N -m memtrain train --distributed ddp|zero1|zero2|fsdp ...

Every rank builds the same model (same seed), reads its own slice of each global batch
(``make_train_loader(rank=, world_size=)``) and the strategies differ only in what each rank
keeps of the training state (P = parameter bytes, N = ranks, Adam: optimizer = 2P):

==========  ============================================  =========  ==========  ===========
strategy    implementation                                 weights    gradients   optimizer
==========  ============================================  =========  ==========  ===========
ddp         ``DistributedDataParallel`` (all-reduce)        P          P           2P
zero1       DDP + :class:`~memtrain.distributed.zero1.     P          P           2P / N
            ShardedZeRO1` (dim-0 chunks of every tensor)
zero2       FSDP2 ``fully_shard``, reshard_after_forward    P/N + P*   P/N         2P / N
            =False (gathered weights kept to backward)
fsdp        FSDP2 ``fully_shard``, reshard_after_forward    P/N + 1    P/N         2P / N
            =True (each block gathered only while used)    block*
==========  ============================================  =========  ==========  ===========

(*) transient: the gathered (unsharded) weights exist from a block's forward to its backward.
FSDP2's "zero2" therefore holds *more* weight bytes at the peak than DDP (the shard plus
the gathered copy); it still wins overall because gradients and optimizer state shrink.

FSDP2 shards every Transformer block and then the root (embeddings, final LayerNorm and
the LM head, whose weight is the token embedding's: the tie survives because both modules
sit in the root's parameter group, so one sharded parameter is registered under both names).
Under ``--precision bf16`` FSDP2 gathers BF16 weights and reduces FP32 gradients
(``MixedPrecisionPolicy``); ``--cpu-offload`` keeps shards, gradients and the optimizer step
on the CPU (``CPUOffloadPolicy``, CUDA only).

Order with the other techniques (see :mod:`memtrain.techniques`): LoRA, attention,
activation checkpointing, loss and compile are applied to the plain model first; the
distributed wrap comes last. Gradient accumulation skips the gradient exchange on all
micro-batches but the last (DDP ``no_sync``; FSDP2 ``set_requires_gradient_sync(False)``).

``--distributed deepspeed-zero2|deepspeed-zero3`` runs DeepSpeed's ZeRO engine instead
when ``deepspeed`` is installed (CUDA); its options are mapped by :func:`deepspeed_config`.

A run's lifetime: :func:`distributed_session` joins the process group (NCCL on CUDA, gloo
on CPU; with a timeout, so a collective whose peer died fails instead of blocking forever:
``MEMTRAIN_DIST_TIMEOUT`` seconds, default 300) and always leaves it, and hands the train
loop a :class:`DistContext` with the few hooks the loop needs.
"""

# The package's modules, one seam each (imported from the module itself, not re-exported here: a
# torch-free verb that reads memtrain.distributed.rank_errors must not start torch by importing the
# package): validation (impossible combinations, before any process group), session (the process
# group's lifetime and the DistContext hooks the train loop uses), wrapping (DDP / FSDP2 / ZeRO-1
# around the finished model), deepspeed_engine (DeepSpeed's config and train step), rank_errors (every rank fails together), launch.
