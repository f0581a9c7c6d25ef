"""Task-neutral data: reading rows (datasets), the resumable prompt iterator (iterator), prompts (messages,
rendering, tokenizing, the length filter: prepare_rows) and tokenizers; a task's own columns, prompts and rewards
live in ``grpax.tasks``."""
