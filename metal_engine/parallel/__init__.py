"""An engine over several ranks on `mx.distributed`: how a rank's share of the model is cut
(`split`: by heads in `shard`, by layers in `pipeline`), the ranks and rank 0's messages
(`group`), rank 0's side of a step (`peers`), the other ranks' loop (`worker`), ranks started
on one host (`local_ranks`) and what they send per step (`traffic`). See docs/distributed.md."""
