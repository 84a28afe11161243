"""SamplingParams refuses out-of-range values with a message naming the field and its range."""

from __future__ import annotations

import re

import pytest

from scheduler.sampling_params import SamplingParams


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("logprobs", 21, "[0, 20]"),
    ("logprobs", -1, "[0, 20]"),
    ("presence_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -2.1, "[-2, 2]"),
    ("repetition_penalty", 0.0, "(0, 100.0]"),
    ("repetition_penalty", 1e300, "(0, 100.0]"),
    ("min_p", 1.5, "[0, 1]"),
    ("min_tokens", -1, "[0, max_tokens=16]"),
    ("min_tokens", 17, "[0, max_tokens=16]"),
])
def test_out_of_range_values_name_the_field_and_the_range(field, value, allowed):
    with pytest.raises(ValueError, match=f"{field} must be .*{re.escape(allowed)}"):
        SamplingParams(**{field: value})


def test_the_limits_themselves_are_accepted():
    params = SamplingParams(logprobs=20, presence_penalty=-2.0, frequency_penalty=2.0,
                            repetition_penalty=0.01, min_p=1.0, min_tokens=16)
    assert params.has_penalties and params.needs_token_history
    assert not SamplingParams(logprobs=0, min_p=0.0).needs_token_history
