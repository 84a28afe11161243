"""From a step's logits to its tokens: the sampler, penalties, logprobs, grammars (structured
output) and the rejection sampler that verifies drafts."""
