"""The disk tier of the prefix cache: the connector that moves blocks and state checkpoints
between memory and disk each step, the per-model stores, the shared directory and its keys."""
