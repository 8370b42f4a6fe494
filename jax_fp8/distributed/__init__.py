"""Collectives for ``shard_map``, one module each:

- :mod:`.expert_dispatch`: an expert-parallel all-to-all with FP8 on the wire (``all_to_all_dequantized``);
- :mod:`.master_weights`: the ZeRO / distributed-optimizer cast of sharded fp32 master weights
  (``quantize_master_weights``, ``gather_master_weights``, ``QuantizedShard``);
- :mod:`.sequence_gather`: the sequence-parallel all-gather along the first dim, FP8 on the wire where
  the blocks allow it (``all_gather_first_dim``, ``all_gather_dequantized``);
- :mod:`.shards`: the shards and windows of the two standard ZeRO splits (``split_masters``,
  ``local_shards``, ``shard_windows``).
"""
from .expert_dispatch import all_to_all_dequantized
from .master_weights import QuantizedShard, gather_master_weights, quantize_master_weights
from .sequence_gather import all_gather_dequantized, all_gather_first_dim
from .shards import local_shards, shard_windows, split_masters

__all__ = ["quantize_master_weights", "gather_master_weights", "QuantizedShard",
           "all_gather_first_dim", "all_gather_dequantized", "all_to_all_dequantized", "local_shards", "shard_windows", "split_masters"]
