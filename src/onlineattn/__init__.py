"""onlineattn: exact attention by the online-softmax recurrence, in PyTorch and Triton."""

from . import cache, dropout, reference
from .api import attention, attention_varlen, attention_with_kvcache, merge_states, merge_states_list
from .sdpa import sdpa

__version__ = "0.1.0"
__all__ = [
    "attention", "attention_varlen", "attention_with_kvcache", "merge_states", "merge_states_list", "sdpa", "cache",
    "dropout", "reference", "__version__",
]
