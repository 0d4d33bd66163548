"""Tensor parallelism inside one worker (--tensor-parallel-size N): one worker is N processes, one per
device; rank 0 runs the serve loop, the scheduler and the sampler and sends each step's inputs to the other
ranks once per step; every rank runs its shard of the model with the same kernels (docs/deployment.md,
"Tensor parallelism").

    shard.py            TpShard: which heads, rows and columns a rank holds; its slices of each checkpoint tensor
    sharded_loading.py  what can shard (refusals), each rank's reads, the weight bytes a rank holds
    group.py            TpGroup: the process groups and the collectives, each under a timeout; faults end the worker
    step_channel.py     StepChannel: a step's inputs from rank 0 to the others, once per step; the keep-alive
    launch.py           TensorParallel: rank 0 starts, watches and stops the other ranks
    follower.py         the other ranks' process: load the shard, then run each step rank 0 sends
"""
