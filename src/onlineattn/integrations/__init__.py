"""Integrations with other libraries: ``integrations.transformers.register()`` adds ``attn_implementation="onlineattn"``
to Hugging Face transformers. Each module imports its library only when called, so importing it costs nothing."""
