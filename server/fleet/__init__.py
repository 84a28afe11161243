"""Several models behind one server: which models under which names (catalog), which are
loaded (fleet: load on demand, unload the least recently used idle one under memory
pressure), and the front door that sends each request to its model's routes (front).
docs/several-models.md says how to use it."""
