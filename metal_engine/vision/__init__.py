"""Images for the multimodal families: preprocessing (numpy + Pillow), the vision towers as MLX
modules, and loading their weights. The text side (placing image features among the prompt's
embeddings) lives with the text models."""
