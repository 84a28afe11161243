"""Benchmarks: a load generator for OpenAI-compatible servers, and side-by-side peer runs."""
