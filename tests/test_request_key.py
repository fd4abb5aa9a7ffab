"""Rollout request keys (``pipeline_rl.rollout.request_key``): each kind's id is today's
string and parses back to its key; anything else is a one-line ValueError naming it."""

from __future__ import annotations

import pytest

from pipeline_rl.rollout.request_key import RequestKey


@pytest.mark.parametrize("key, rid", [
    (RequestKey(7, 3), "7:3"),                                               # a group's completion
    (RequestKey(1 << 40, 0, turn=2), "1099511627776:0#2"),                    # an episode's turn
    (RequestKey.of_eval(3, 17, 2), "eval:3:17:2"),                           # an evaluation's sample
    (RequestKey.of_eval(3, 17, 0).at_turn(1), "eval:3:17:0#1"),              # an evaluation episode's turn
    (RequestKey(5, 1).agent_answer(4, 2), "5:1#a4.2"),                       # an agent request's answer
    (RequestKey.of_eval(0, 1, 2).agent_answer(0, 0), "eval:0:1:2#a0.0"),
])
def test_each_kind_round_trips_as_todays_id(key: RequestKey, rid: str) -> None:
    assert key.to_id() == rid and RequestKey.parse(rid) == key
    assert key.episode == RequestKey(key.group, key.index, key.prompt)
    assert key.evaluation == (not rid.split(":")[0].isdigit())   # an evaluation's never looks like a group's


@pytest.mark.parametrize("rid", ["", "7", "7:", "7:3:1", "-1:0", "7:3#", "7:3#x", "7:3#a4", "eval:3:17",
                                 "eval:3:17:2:1", "7:3#1#2", " 7:3", "7:3\n", "٣:1", "smoke-0"])
def test_a_bad_id_is_one_line_naming_it(rid: str) -> None:
    with pytest.raises(ValueError) as e:
        RequestKey.parse(rid)
    assert "\n" not in str(e.value) and repr(rid) in str(e.value)


def test_a_bad_key_is_refused_in_one_line() -> None:
    for make in (lambda: RequestKey(-1, 0), lambda: RequestKey(0, 0, answer=1), lambda: RequestKey(0, True)):
        with pytest.raises(ValueError) as e:
            make()
        assert "\n" not in str(e.value)
