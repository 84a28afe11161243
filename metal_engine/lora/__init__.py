"""LoRA adapters served over one base model, many in one step.

    adapter_files   an adapter dir (PEFT's or mlx-lm's) read into low-rank pairs per module
    slots           the loaded adapters stacked per targeted linear; a step's rows -> slots
"""
