"""Drafters that run on the device for speculative decoding: a small draft model, or the
checkpoint's multi-token-prediction head."""
