"""onlineattn: exact attention by the online-softmax recurrence, in PyTorch and Triton."""

from . import reference
from .api import attention, merge_states, merge_states_list

__version__ = "0.1.0"
__all__ = ["attention", "merge_states", "merge_states_list", "reference", "__version__"]
