"""Attention over a sequence sharded across ranks (context parallelism): ring attention and its shard layouts."""

from .layout import shard_sequence, unshard_sequence
from .ring import ring_attention

__all__ = ["ring_attention", "shard_sequence", "unshard_sequence"]
