"""env.backend=vector (the simulator's own vector env) beside the gymnasium loop, and env.wrappers."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import tests.toy_envs  # noqa: F401  (registers the toy envs)
from rltrain import build
from rltrain.envs import make_envs
from rltrain.errors import ConfigError
from tests.conftest import learning_check, make_config

ATARI_VECTOR = {"frameskip": 4, "repeat_action_probability": 0.0, "noop_max": 30, "stack_num": 4,
                "reward_clipping": False}


def test_vector_cartpole_resets_in_the_step_that_ended_the_episode_and_keeps_the_final_observation():
    env = make_envs("CartPole-v1", 8, backend="vector", kwargs={"max_episode_steps": 20}, seed=0)
    obs = env.reset().copy()
    rng = np.random.default_rng(0)
    truncations = terminations = 0
    for _ in range(300):
        next_obs, reward, terminated, truncated, new_obs = (x.copy() for x in env.step(rng.integers(0, 2, 8)))
        done = terminated | truncated
        assert (reward == 1).all()  # no frame is a reset-only step of reward 0
        # Where no episode ended, the next observation is what the policy sees next.
        np.testing.assert_array_equal(new_obs[~done], next_obs[~done])
        # Where one ended: the final observation continues the old state; the new one is a fresh reset.
        assert (np.abs(new_obs[done]) <= 0.05).all()
        assert (np.abs(next_obs[done] - obs[done]) < 0.5).all()
        truncations += int(truncated.sum())
        terminations += int((terminated & ~truncated).sum())
        obs = new_obs
    assert truncations > 0 and terminations > 0
    env.close()


def test_both_backends_give_the_same_batch_keys_and_dtypes(tmp_path):
    batches = {}
    for backend in ("gymnasium", "vector"):
        trainer = build(make_config(f"env.backend={backend}", "trainer.total_frames=512"), run_dir=tmp_path / backend)
        batches[backend] = next(iter(trainer.collector))
        trainer.collector.close()
    gym_batch, vec_batch = batches["gymnasium"], batches["vector"]
    keys = set(gym_batch.keys(include_nested=True, leaves_only=True))
    assert keys == set(vec_batch.keys(include_nested=True, leaves_only=True))
    for key in keys:
        assert gym_batch[key].dtype == vec_batch[key].dtype and gym_batch[key].shape == vec_batch[key].shape, key


@learning_check
def test_ppo_solves_cartpole_on_the_vector_backend(tmp_path):
    summary = build(make_config("env.backend=vector"), run_dir=tmp_path).fit()
    assert summary["solved"] is True and summary["train_return"] >= 475
    assert summary["eval_return"] >= 400


def test_a_vector_cartpole_resumes_mid_episode_exactly():
    env = make_envs("CartPole-v1", 4, backend="vector", seed=3)
    env.reset()
    actions = np.random.default_rng(1).integers(0, 2, (40, 4))
    for a in actions[:15]:
        env.step(a)
    saved = env.state_dict()
    assert saved is not None
    expected = [tuple(x.copy() for x in env.step(a)) for a in actions[15:]]
    restored = make_envs("CartPole-v1", 4, backend="vector", seed=99)
    restored.load_state_dict(saved)
    for a, want in zip(actions[15:], expected):
        for got, w in zip(restored.step(a), want):
            np.testing.assert_array_equal(got, w)


def test_envs_without_a_usable_vector_env_are_refused_naming_the_backend(tmp_path):
    with pytest.raises(ConfigError, match="has no vectorized implementation .* env.backend=gymnasium"):
        build(make_config("env=pendulum", "env.backend=vector"), run_dir=tmp_path)
    with pytest.raises(ConfigError, match="env.backend must be one of gymnasium, vector, envpool"):
        build(make_config("env.backend=jax"), run_dir=tmp_path)
    with pytest.raises(ConfigError, match="env.wrappers wrap single gymnasium envs"):
        build(make_config("env.backend=vector", "env.wrappers=[{wrapper: FrameStackObservation, stack_size: 2}]"),
              run_dir=tmp_path)
    assert not any(tmp_path.iterdir())


def test_wrappers_from_the_config_wrap_every_env(tmp_path):
    trainer = build(make_config("env.wrappers=[{wrapper: FrameStackObservation, stack_size: 3}]",
                                "trainer.total_frames=512"), run_dir=tmp_path)
    try:
        batch = next(iter(trainer.collector))
    finally:
        trainer.collector.close()
    assert batch["observation"].shape == (32, 16, 3, 4)  # 3 stacked CartPole observations
    # The next observation's stack is this one shifted by a frame: the oldest out, the new one in.
    ongoing = ~batch["done"]
    torch.testing.assert_close(batch["next", "observation"][..., :-1, :][ongoing],
                               batch["observation"][..., 1:, :][ongoing])


@pytest.mark.parametrize("wrappers,match", [
    ("[{wrapper: NoSuchWrapper}]", r"env.wrappers\[0\]: wrapper 'NoSuchWrapper' not found"),
    ("[{wrapper: FrameStackObservation, stack_size: 0}]", r"env.wrappers\[0\] \(FrameStackObservation\) failed"),
    ("[FrameStackObservation]", r"env.wrappers\[0\] must be a mapping with a 'wrapper' key"),
])
def test_a_wrapper_that_does_not_fit_is_refused_naming_its_position(wrappers, match, tmp_path):
    with pytest.raises(ConfigError, match=match):
        build(make_config(f"env.wrappers={wrappers}"), run_dir=tmp_path)


def test_sign_reward_trains_on_reward_signs_and_is_refused_where_the_algo_cannot(tmp_path):
    from tensordict import TensorDict

    trainer = build(make_config("env.sign_reward=true", "algo.gamma=0.5", "algo.gae_lambda=1.0"), run_dir=tmp_path)
    trainer.collector.close()
    ppo = trainer.algo
    with torch.no_grad():  # a critic of 0 everywhere: the returns are the discounted signs alone
        ppo.policy.critic[-1].weight.zero_()
        ppo.policy.critic[-1].bias.zero_()
    steps = 3
    batch = TensorDict({"observation": torch.zeros(steps, 1, 4), "action": torch.zeros(steps, 1, dtype=torch.long),
                        "log_prob": torch.zeros(steps, 1), "reward": torch.tensor([[5.0], [-0.2], [0.0]]),
                        "terminated": torch.tensor([[False], [False], [True]]),
                        "done": torch.tensor([[False], [False], [True]]),
                        "next": {"observation": torch.zeros(steps, 1, 4)}}, batch_size=[steps, 1])
    returns = ppo._prepare(batch).returns
    torch.testing.assert_close(returns, torch.tensor([1 - 0.5, -1.0, 0.0]))  # sign(5) + 0.5 sign(-0.2), ...
    with pytest.raises(ConfigError, match="env.sign_reward=true, but algo=SAC does not transform rewards"):
        build(make_config("algo=sac", "env=pendulum", "env.sign_reward=true"), run_dir=tmp_path / "sac")


ale_py = pytest.importorskip("ale_py", reason="the atari extra: pip install 'rltrain[atari]'")


def test_atari_vector_and_wrapped_loop_give_the_same_uint8_frames():
    vector = make_envs("ALE/Breakout-v5", 2, backend="vector", kwargs=ATARI_VECTOR)
    loop = make_envs("ALE/Breakout-v5", 2, backend="gymnasium",
                     kwargs={"frameskip": 1, "repeat_action_probability": 0.0},
                     wrappers=[{"wrapper": "AtariPreprocessing", "frame_skip": 4, "noop_max": 30},
                               {"wrapper": "FrameStackObservation", "stack_size": 4}])
    for env in (vector, loop):
        assert env.spec.observation.shape == (4, 84, 84) and env.spec.observation.kind == "image"
        obs = env.reset()
        assert obs.dtype == np.uint8 and obs.shape == (2, 4, 84, 84)
        ended, rng = 0, np.random.default_rng(0)
        for _ in range(1000):
            next_obs, _, terminated, truncated, obs = env.step(rng.integers(0, 4, 2))
            ended += int((terminated | truncated).sum())
            if ended:
                break
        assert ended > 0  # episodes ended and were reset along the way
        env.close()


def test_ppo_runs_on_atari_frames_with_the_nature_cnn(tmp_path):
    summary = build(make_config("+recipe=ppo_atari", "env.num_envs=2", "collector.frames_per_batch=64",
                                "algo.minibatch_size=32", "algo.epochs=1", "trainer.total_frames=128",
                                "hooks.eval.episodes=1", "hooks.eval.at_end=false"), run_dir=tmp_path).fit()
    assert summary["frames"] == 128


envpool = pytest.importorskip("envpool", reason="the envpool extra: pip install 'rltrain[envpool]'")


def test_envpool_resets_ended_envs_in_the_same_step_and_keeps_their_final_observation():
    env = make_envs("CartPole-v1", 4, backend="envpool", seed=0)
    obs = env.reset().copy()
    rng = np.random.default_rng(0)
    ended = 0
    for _ in range(200):
        next_obs, reward, terminated, truncated, new_obs = (x.copy() for x in env.step(rng.integers(0, 2, 4)))
        done = terminated | truncated
        assert (reward == 1).all()
        np.testing.assert_array_equal(new_obs[~done], next_obs[~done])
        assert (np.abs(new_obs[done]) <= 0.05).all() and (np.abs(next_obs[done] - obs[done]) < 0.5).all()
        ended += int(done.sum())
        obs = new_obs
    assert ended > 0
    assert env.state_dict() is None  # EnvPool does not pickle: a resume starts fresh episodes
    env.close()


@learning_check
def test_ppo_solves_cartpole_on_envpool(tmp_path):
    summary = build(make_config("env.backend=envpool"), run_dir=tmp_path).fit()
    assert summary["solved"] is True and summary["train_return"] >= 475


def test_envpool_atari_frames_are_uint8_images_and_unknown_tasks_are_refused(tmp_path):
    env = make_envs("ALE/Breakout-v5", 2, backend="envpool", kwargs={"episodic_life": False, "reward_clip": False})
    assert env.spec.observation.kind == "image" and env.reset().shape == (2, 4, 84, 84)
    env.close()
    with pytest.raises(ConfigError, match="is not an EnvPool task"):
        build(make_config("env.id=tests.toy_envs:Catch-v0", "env.backend=envpool"), run_dir=tmp_path)
