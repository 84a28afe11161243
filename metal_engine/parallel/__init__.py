"""Tensor parallelism over `mx.distributed`: the weight split (`shard`), the ranks and rank
0's messages (`group`), rank 0's side of a step (`tensor_parallel`), the other ranks' loop
(`worker`) and ranks started on one host (`local_ranks`). See docs/distributed.md."""
