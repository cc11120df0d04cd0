"""Integrations with training frameworks.

- `aiopersist.integrations.transformers`: `AioPersistCallback` for the Hugging Face
  ``Trainer``.

Each module imports its framework only when it is imported itself.
"""
