"""From a model directory to a model in memory: its config, dtype, weights (quantized or
not), their bytes, and its tokenizer."""
