"""Greedy tokens of a few prompts through an engine whose ranks (tensor- or pipeline-parallel)
run on this host.

A process joins one group of ranks for its life, so each engine with ranks runs in a process
of its own: `python tests/parallel_run.py MODEL_DIR TP PP` prints the tokens as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import metal_engine  # noqa: F401  (first: it picks mlx's BLAS)
from metal_engine.config import EngineConfig
from metal_engine.engine_build import build_engine
from scheduler import SamplingParams

# A prompt longer than the step's token budget (chunked over steps, with decodes beside it),
# and short ones.
PROMPTS = [[1, 5, 9, 33, 7, 100, 3, 8, 9, 44, 12, 17, 90, 4, 5, 6, 7, 8, 9, 10],
           [1, 60, 61, 62], [1, 70, 7]]
MAX_TOKENS = 10


def greedy_tokens(model_dir: Path, tensor: int = 1, pipeline: int = 1) -> dict[str, list[int]]:
    engine = build_engine(EngineConfig(
        model_dir=model_dir, tensor_parallel_size=tensor, pipeline_parallel_size=pipeline,
        kv_cache_memory=16 << 20, max_num_batched_tokens=16))
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
    engine.close()
    return tokens


def greedy_tokens_in_a_process(model_dir: Path, tensor: int = 1, pipeline: int = 1) -> dict:
    done = subprocess.run([sys.executable, __file__, str(model_dir), str(tensor), str(pipeline)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


if __name__ == "__main__":
    print(json.dumps(greedy_tokens(Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]))))
