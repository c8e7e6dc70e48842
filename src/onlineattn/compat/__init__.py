"""Drop-in replacements for other libraries' attention entry points.

``from onlineattn.compat import flash_attn`` gives flash-attn 2's functions (``flash_attn.flash_attn_func`` and the
rest) computed by onlineattn, so code written against flash-attn runs unchanged where it is not installed (the CPU,
or a GPU it does not support).
"""
