"""A request's tokens do not depend on what else runs in its batch (found by a differential test of session 29 on
the embedded default model): another request's logit bias or penalties, another row's top_p, and the one noise
value that rounded to 1."""

import pytest

from hylo import LLM, SamplingParams
from hylo.constrain.spec import Constraint

A, B = "def fibonacci(n):", "import os\n"
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def llm():
    with LLM(None, device="cpu", verbose=False, enable_prefix_caching=False) as model:
        yield model


def _ids(llm, prompts, params):
    return [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("other", [dict(logit_bias={10: 10.0}), dict(frequency_penalty=-2.0),
                                   dict(repetition_penalty=1.5, presence_penalty=1.0), dict(min_tokens=5)])
def test_another_requests_penalties_leave_a_greedy_row_alone(llm, other):
    """A step with a penalized row applied the penalty tables to every row: the others read a never-written row
    (repetition 0: a seen token's logit became infinite) or one their slot's earlier request left (its bias)."""
    alone = _ids(llm, [A], GREEDY)[0]
    beside = _ids(llm, [A, B], [GREEDY, SamplingParams(max_tokens=12, temperature=0, **other)])[0]
    assert beside == alone
    # and once more after it, in a slot a penalized request used before
    assert _ids(llm, [A, B], [GREEDY, GREEDY])[0] == alone


def test_a_seeded_row_keeps_its_draw_beside_a_top_p_row(llm):
    """A batch with a top_p < 1 row filtered every row: at top_p 1 the float32 running sum reached 1.0 before the
    tail and cut it, so a seeded row's draw changed with its neighbours."""
    seeded = SamplingParams(max_tokens=33, temperature=0.8, seed=980125353)
    alone = _ids(llm, [[452]], seeded)[0]
    beside = _ids(llm, [[452], "x"], [seeded, SamplingParams(max_tokens=40, temperature=0.8, seed=1, top_p=0.5)])[0]
    assert beside == alone


def test_a_zero_probability_token_is_never_drawn(llm):
    """Seed 74 draws the top noise value at token 1962 on step 31; it rounded to u = 1, where a zero probability's
    race value was NaN and won: top_k=1 left greedy, a -100 bias and a regex constraint were broken."""
    greedy = _ids(llm, [A], SamplingParams(max_tokens=40, temperature=0))[0]
    assert _ids(llm, [A], SamplingParams(max_tokens=40, temperature=1.0, top_k=1, seed=74))[0] == greedy
    biased = _ids(llm, [A], SamplingParams(max_tokens=40, temperature=1.0, seed=74, logit_bias={1962: -100}))[0]
    assert 1962 not in biased
    out = llm.generate([A], SamplingParams(max_tokens=40, temperature=1.0, seed=74,
                                           constraint=Constraint.regex("[0-9]{1,200}")), use_tqdm=False)[0]
    assert out.text.isdigit()
