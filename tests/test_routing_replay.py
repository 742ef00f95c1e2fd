"""Routing replay (R3): routed experts through Generation, ledger, trajectory, SGLang's wire form and slime's Sample."""

from __future__ import annotations

import base64
import json
import pickle

import numpy as np
import pytest

from slime_env import Generation
from slime_env.errors import InvalidInput
from slime_env.ledger import TokenLedger
from slime_env.routing import RoutedExperts, RoutingRecord, stream_routing
from slime_env.trajectory import Trajectory
from slime_env.types import Task


def rows(n: int, layers: int = 3, k: int = 2, seed: int = 0) -> RoutedExperts:
    return RoutedExperts.from_array(np.random.default_rng(seed).integers(0, 4, (n, layers, k)))


def test_routed_experts_roundtrip_and_bad_shapes():
    r = rows(5)
    assert r.shape == (5, 3, 2) and len(r.data) == 5 * 3 * 2 * 2  # int16
    assert np.array_equal(RoutedExperts.from_dict(json.loads(json.dumps(r.to_dict()))).to_numpy(), r.to_numpy())
    assert pickle.loads(pickle.dumps(r)) == r
    assert np.array_equal(r.slice(1, 3).to_numpy(), r.to_numpy()[1:3])
    with pytest.raises(InvalidInput, match=r"\[tokens, layers, top_k\].*shape \(5, 6\)"):
        RoutedExperts.from_array(np.zeros((5, 6), dtype=np.int32))
    with pytest.raises(InvalidInput, match="integers"):
        RoutedExperts.from_array(np.zeros((2, 3, 2), dtype=np.float32))
    with pytest.raises(InvalidInput, match=r"\[-1, 32767\]"):
        RoutedExperts.from_array(np.full((1, 1, 1), 40000))
    with pytest.raises(InvalidInput, match="another model"):
        r.check_model(num_layers=4, top_k=2, num_experts=4)
    with pytest.raises(InvalidInput, match="expert 9 but the model has 4 experts"):
        RoutedExperts.from_array(np.full((1, 3, 2), 9)).check_model(3, 2, 4)
    r.check_model(3, 2, 4)


def test_generation_and_ledger_keep_routing_of_generated_tokens_only():
    with pytest.raises(InvalidInput, match="3 token ids but routed experts for 5 tokens"):
        Generation((1, 2, 3), (-0.1,) * 3, routed_experts=rows(5))
    led = TokenLedger([7, 8, 9])
    led.add_generated([1, 2], [-0.5, -0.6], 0, rows(2, seed=1))
    led.add_inserted([50, 51, 52], 0)
    led.add_generated([3, 4, 5], [-0.1] * 3, 1)                      # routing lost (aborted / engine gave none)
    led.add_inserted([53], 1)
    led.add_generated([6], [-0.2], 2, rows(1, seed=2))
    with pytest.raises(InvalidInput, match="another model"):
        led.add_generated([7], [-0.2], 3, rows(1, layers=5))
    with pytest.raises(InvalidInput, match="2 generated ids but routed experts for 1"):
        led.add_generated([7, 8], [-0.2] * 2, 3, rows(1))
    rec = led.routing()
    assert rec.ranges == ((0, 2), (9, 10)) and rec.num_tokens == 3
    per = rec.per_response_token(len(led.response_ids))
    assert (per[2:9] == -1).all() and np.array_equal(per[0:2], rows(2, seed=1).to_numpy())
    traj = Trajectory(task=Task(prompt="p"), prompt_ids=led.prompt_ids, response_ids=led.response_ids,
                      loss_mask=led.loss_mask, rollout_logprobs=led.rollout_logprobs, spans=led.spans,
                      turn_rewards=[1.0], reward=1.0, status="completed", routing=rec)
    traj.check()
    back = Trajectory.from_dict(json.loads(json.dumps(traj.to_dict())))
    assert back.routing == rec and pickle.loads(pickle.dumps(traj)).routing == rec
    # slime's layout: row i is the forward over token i (predicting token i + 1); prompt rows are -1
    sample = traj.to_slime_sample()
    re = sample["rollout_routed_experts"]
    assert re.dtype == np.int32 and re.shape == (len(sample["tokens"]) - 1, 3, 2)
    assert (re[:2] == -1).all() and np.array_equal(re[2:4], per[0:2]) and np.array_equal(re[2 + 9], per[9])
    # offpolicy tokens (a resumed partial rollout) leave the loss: their routing goes too
    led.mask_offpolicy()
    assert led.routing() is None
    with pytest.raises(InvalidInput, match="up to 10 of 4"):
        Trajectory(task=Task(prompt="p"), prompt_ids=[1], response_ids=[1, 2, 3, 4], loss_mask=[1] * 4,
                   rollout_logprobs=[-1.0] * 4, spans=[], turn_rewards=[], reward=0.0, status="completed",
                   routing=rec)


def test_sglang_wire_form():
    prompt, gen = 4, rows(3, seed=3)
    payload = gen.to_sglang(prompt)  # serve-engine's answer: [prompt + completion - 1, L, K] int32, prompt rows -1
    arr = np.frombuffer(base64.b64decode(payload), dtype="<i4").reshape(prompt + 3 - 1, 3, 2)
    assert (arr[:prompt - 1] == -1).all() and np.array_equal(arr[prompt - 1:], gen.to_numpy())
    back = RoutedExperts.from_sglang(payload, prompt_tokens=prompt, completion_tokens=3, num_layers=3, top_k=2)
    assert back == gen
    with pytest.raises(InvalidInput, match="expected 6 rows for 4 prompt \\+ 3 generated.*wrong layers"):
        RoutedExperts.from_sglang(payload, prompt_tokens=4, completion_tokens=3, num_layers=4, top_k=2)
    with pytest.raises(InvalidInput, match="not base64"):
        RoutedExperts.from_sglang("%%%", prompt_tokens=4, completion_tokens=3, num_layers=3, top_k=2)
    assert stream_routing(1, 2, RoutingRecord(((0, 2),), rows(2))).shape == (2, 3, 2)
