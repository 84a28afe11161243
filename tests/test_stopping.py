"""The stop judge (scheduler.stopping): one decision per new token, in a fixed precedence."""

from __future__ import annotations

from scheduler import Request, SamplingParams
from scheduler.stopping import Stop, judge

EOS = 2


class Script:
    """An output check that answers from a script: token id -> its stop; records its feed."""

    def __init__(self, stops: dict[int, Stop]) -> None:
        self.stops, self.fed = stops, []

    def check(self, token_id: int) -> Stop | None:
        self.fed.append(token_id)
        return self.stops.get(token_id)


def request(max_tokens: int = 10, **params) -> Request:
    return Request("r", [1, 1, 1], SamplingParams(max_tokens=max_tokens, **params),
                   eos_token_ids=(EOS,))


def test_the_first_token_that_stops_ends_the_request_and_drops_the_rest():
    check = Script({6: Stop("stop", "END")})
    assert judge(request(), 0, [5, 6, 7], 100, check) == (2, Stop("stop", "END"))
    assert check.fed == [5, 6]  # the dropped draft is never decoded
    assert judge(request(), 0, [5, 7], 100, Script({})) == (2, None)


def test_a_token_stop_outranks_a_stop_string_and_a_stop_string_outranks_length():
    both = Script({EOS: Stop("stop", "END")})
    assert judge(request(), 0, [EOS], 100, both) == (1, Stop("stop"))
    assert judge(request(stop_token_ids=(9,)), 0, [9], 100, Script({})) == (1, Stop("stop"))
    last = Script({5: Stop("stop", "END")})  # the stop string comes with the last token allowed
    assert judge(request(max_tokens=3), 2, [5], 100, last) == (1, Stop("stop", "END"))
    assert judge(request(max_tokens=3), 2, [5], 100, Script({})) == (1, Stop("length"))


def test_a_failed_grammar_outranks_everything_else():
    failed = Stop("error", error="the grammar refused the token")
    assert judge(request(max_tokens=1), 0, [EOS], 100, Script({EOS: failed})) == (1, failed)


def test_eos_is_ignored_on_request_and_a_full_context_is_length():
    assert judge(request(ignore_eos=True), 0, [EOS, 5], 100) == (2, None)
    assert judge(request(), 0, [5, 6], 5) == (2, Stop("length"))  # 3 prompt + 2 outputs
