"""The cache in memory: the paged K/V pools and recurrent-state slots (the runner's side of
the scheduler's cache groups), how the budget is split between them, and how much memory
the budget gets."""
