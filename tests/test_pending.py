"""An update that a stop request interrupts between two gradient steps, saved and resumed in a fresh
learner (as a checkpoint carries it), ends exactly as the same update run without a stop."""

from __future__ import annotations

import io
from collections.abc import Callable
from dataclasses import replace

import pytest
import torch
from tensordict import TensorDict

from benchmarks.losses import box_spec
from rltrain.algos import PPO, SAC, ActorCritic, SquashedGaussianActor
from rltrain.envs import Leaf
from tests.test_compile import ppo_batch, weights


def stop_before_step(n: int) -> Callable[[], bool]:
    """A ``should_stop`` that turns true before the ``n``-th gradient step (0: before the first)."""
    asked = iter(range(10**9))
    return lambda: next(asked) >= n


def through_a_checkpoint(state: dict) -> dict:
    """``state`` as a resumed run reads it: written and loaded as a checkpoint is (plain values only)."""
    f = io.BytesIO()
    torch.save(state, f)
    f.seek(0)
    return torch.load(f, map_location="cpu", weights_only=True)


def ppo(observation: str) -> PPO:
    torch.manual_seed(0)
    spec = box_spec(17, 6)
    if observation == "dict":
        spec = replace(spec, observation={"position": Leaf((5,), "float32", "vector"),
                                          "goal": Leaf((12,), "float32", "vector")})
    # 512 frames in minibatches of 128: four steps per epoch, twelve in all. With memory: 16 envs' 32 steps in
    # windows of 12 (the last padded), 10 windows a minibatch: five steps per epoch.
    recurrent = {"recurrent": "lstm", "recurrent_size": 8} if observation == "recurrent" else {}
    return PPO(ActorCritic(spec, hidden_sizes=[32, 32], **recurrent), total_frames=4096, minibatch_size=128, epochs=3,
               sequence_length=12, compile=False, cuda_graph=False)


def batch(seed: int, observation: str) -> TensorDict:
    """512 frames of random data, the 17 observation features split in two for a Dict observation."""
    b = ppo_batch(seed)
    if observation == "recurrent":
        b["recurrent_state"] = torch.randn(32, 16, 16, generator=torch.Generator().manual_seed(seed))
    if observation == "dict":
        for key in ("observation", ("next", "observation")):
            position, goal = b[key].split([5, 12], dim=-1)
            b[key] = TensorDict({"position": position, "goal": goal}, batch_size=b.batch_size)
    return b


@pytest.mark.parametrize("observation", ["vector", "dict", "recurrent"])
@pytest.mark.parametrize("stop_at", [0, 5, 8])  # before the first step; mid-epoch; as the last epoch begins
def test_a_ppo_update_stopped_between_minibatches_resumes_to_the_same_weights(stop_at, observation):
    full = ppo(observation)
    full.update(batch(1, observation))
    torch.manual_seed(7)
    expected = full.update(batch(2, observation))

    stopped = ppo(observation)
    stopped.update(batch(1, observation))
    torch.manual_seed(7)
    assert stopped.update(batch(2, observation), stop_before_step(stop_at)) is None
    saved, rng = through_a_checkpoint(stopped.state_dict()), torch.get_rng_state()
    assert set(saved["pending"]) == {"obs", "action", "old_log_prob", "old_value", "advantages", "returns",
                                     "epoch", "perm", "next", "losses", "diagnostics", "state", "starts",
                                     "valid"}  # what checkpoints hold (the last three: a network with memory's)
    steps_per_epoch = 5 if observation == "recurrent" else 4
    assert (saved["pending"]["epoch"], saved["pending"]["next"]) == divmod(stop_at, steps_per_epoch)

    resumed = ppo(observation)
    resumed.load_state_dict(saved)
    torch.set_rng_state(rng)
    assert resumed.update(None) == expected
    assert resumed.state_dict()["pending"] is None
    for r, f in zip(weights(resumed.policy), weights(full.policy), strict=True):
        assert torch.equal(r, f)


def sac() -> SAC:
    torch.manual_seed(0)
    return SAC(SquashedGaussianActor(box_spec(17, 6), hidden_sizes=[32, 32]), total_frames=4096, warmup_frames=0,
               batch_size=64, utd=0.25, critic_hidden_sizes=[32, 32], compile=False, cuda_graph=False)


def test_a_sac_update_stopped_between_gradient_steps_resumes_to_the_same_weights():
    frames = ppo_batch(1, steps=8, envs=4)
    full = sac()
    torch.manual_seed(7)
    expected = full.update(frames)  # 32 frames at utd 0.25: 8 gradient steps

    stopped = sac()
    torch.manual_seed(7)
    assert stopped.update(frames, stop_before_step(3)) is None
    saved, rng = through_a_checkpoint(stopped.state_dict()), torch.get_rng_state()
    assert saved["pending"]["steps"] == 8 and len(saved["pending"]["metrics"]) == 3  # what checkpoints hold
    assert stopped.state_dict(replay_buffer=False)["pending"] is None  # the steps owed need the buffer

    resumed = sac()
    resumed.load_state_dict(saved)
    torch.set_rng_state(rng)
    assert resumed.update(None) == expected
    for r, f in zip(weights(resumed.policy, resumed.q, resumed.q_target), weights(full.policy, full.q, full.q_target),
                    strict=True):
        assert torch.equal(r, f)
