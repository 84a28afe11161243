"""Speculative decoding, scheduler side: config, draft proposers, draft-length policy. No mlx."""
