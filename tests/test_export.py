"""rltrain.export: a trained policy as one ONNX or TorchScript file, run by onnxruntime and torch.jit.load on 1,000
observations from its env and compared with rltrain's own policy; the distribution's parameters; refusals."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnxruntime
import pytest
import torch
from omegaconf import OmegaConf

from rltrain import build, checkpoint
from rltrain.algos.recurrent import Memory
from rltrain.envs.spaces import to_torch
from rltrain.errors import CheckpointError
from rltrain.export import export, load_policy
from rltrain.wiring import env_maker
from tests.conftest import ROOT, make_config
from tests.test_spaces import CATCH, SMALL_CNN

SHORT = ("trainer.stop_at_return=null", "hooks.eval.episodes=1")
RUNS = {  # a policy of each kind, trained briefly (the check is the file's fidelity, not the policy's quality)
    "ppo_discrete": ("trainer.total_frames=1024",),
    "ppo_box_normalized": ("env=pendulum", "algo.network.normalize_obs=true", "trainer.total_frames=1024"),
    "ppo_lstm": ("algo.network.recurrent=lstm", "algo.network.recurrent_size=16", "trainer.total_frames=1024"),
    "sac": ("algo=sac", "env=pendulum", "algo.warmup_frames=256", "algo.utd=0.25", "trainer.total_frames=768",
            "algo.network.normalize_obs=true"),
    "dqn_dict_masked": ("algo=dqn", "env.id=tests.toy_envs:MaskedChoice-v0", "algo.warmup_frames=256",
                        "trainer.total_frames=1024"),
    "dqn_pixels_dueling": ("algo=dqn", f"env.id={CATCH}", "algo.warmup_frames=256", "algo.network.dueling=true",
                           "trainer.total_frames=1024", *SMALL_CNN),
}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The run dir of each of RUNS (trained once for the module)."""
    dirs = {}

    def get(name: str):
        if name not in dirs:
            dirs[name] = tmp_path_factory.mktemp(name)
            build(make_config(*RUNS[name], *SHORT), run_dir=dirs[name]).fit()
        return dirs[name]

    return get


def leaves(obs) -> list[np.ndarray]:
    return [obs] if not isinstance(obs, dict) else list(obs.values())


def rollout(run_dir, steps: int = 125, envs: int = 8):
    """``steps * envs`` observations of the run's env, stepped by the policy's own deterministic actions from a fresh
    seed; for each step the file's inputs (the observation's leaves, then the state where the policy has one) and
    rltrain's own action."""
    policy, _, saved = load_policy(run_dir)
    env = env_maker(OmegaConf.create(checkpoint.load(saved)[checkpoint.CONFIG_KEY]))(num_envs=envs, seed=12345)
    memory = Memory(policy, envs, first_env=0)
    obs = env.reset()
    with torch.inference_mode():
        for _ in range(steps):
            inputs = [np.array(x) for x in leaves(obs)]
            if memory.state is not None:
                inputs.append(memory.state.numpy().copy())
            action, _ = memory.act(to_torch(obs), deterministic=True)
            yield inputs, action.numpy()
            _, _, terminated, truncated, obs = env.step(action.numpy())
            memory.forget(terminated | truncated)
    env.close()


@pytest.mark.parametrize("name", list(RUNS))
def test_the_exported_file_acts_as_rltrains_policy_on_1000_observations(name, trained, tmp_path):
    run_dir = trained(name)
    onnx_file = export(run_dir, "onnx", tmp_path / "policy.onnx")
    script_file = export(run_dir, "torchscript", tmp_path / "policy.pt")
    session = onnxruntime.InferenceSession(str(onnx_file))
    names = [i.name for i in session.get_inputs()]
    scripted = torch.jit.load(str(script_file))
    continuous = name.startswith(("sac", "ppo_box"))
    seen = 0
    for inputs, expected in rollout(run_dir):
        outputs = session.run(None, dict(zip(names, inputs)))
        traced = scripted(*map(torch.from_numpy, inputs))
        traced = traced[0] if isinstance(traced, tuple) else traced
        for got in (outputs[0], traced.numpy()):
            if continuous:
                np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5)
            else:
                np.testing.assert_array_equal(got, expected)
        seen += len(expected)
    assert seen == 1000


def test_a_recurrent_file_takes_and_returns_its_state(trained, tmp_path):
    run_dir = trained("ppo_lstm")
    session = onnxruntime.InferenceSession(str(export(run_dir, "onnx", tmp_path / "p.onnx")))
    inputs = [(i.name, i.shape) for i in session.get_inputs()]
    assert inputs == [("observation", ["batch", 4]), ("state", ["batch", 32])]  # an LSTM of 16: hidden and cell
    assert [o.name for o in session.get_outputs()] == ["action", "next_state"]
    policy, _, _ = load_policy(run_dir)
    obs = np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)
    state = np.zeros((3, 32), np.float32)
    for _ in range(4):  # the state the file returns carries the memory forward, as rltrain's policy's does
        action, state = session.run(None, {"observation": obs, "state": state})
    reference = policy.initial_state(3)
    for _ in range(4):
        expected, _, reference = policy.act_in_state(torch.from_numpy(obs), reference, deterministic=True)
    np.testing.assert_array_equal(action, expected.numpy())
    np.testing.assert_allclose(state, reference.detach().numpy(), atol=1e-5)


def test_distribution_parameters_are_what_the_policy_samples_from(trained, tmp_path):
    run_dir = trained("sac")
    policy, _, _ = load_policy(run_dir)
    session = onnxruntime.InferenceSession(str(export(run_dir, "onnx", tmp_path / "d.onnx", distribution=True)))
    assert [o.name for o in session.get_outputs()] == ["mean", "log_std"]
    obs = np.random.default_rng(1).normal(size=(5, 3)).astype(np.float32)
    mean, log_std = session.run(None, {"observation": obs})
    expected_mean, expected_log_std = policy.mean_log_std(torch.from_numpy(obs))
    np.testing.assert_allclose(mean, expected_mean.detach().numpy(), atol=1e-5)
    np.testing.assert_allclose(log_std, expected_log_std.detach().numpy(), atol=1e-5)
    q_session = onnxruntime.InferenceSession(str(export(trained("dqn_dict_masked"), "onnx", tmp_path / "q.onnx",
                                                        distribution=True)))
    assert [o.name for o in q_session.get_outputs()] == ["q_values"]
    q_policy, q_spec, _ = load_policy(trained("dqn_dict_masked"))
    assert [i.name for i in q_session.get_inputs()] == list(q_spec.observation) == ["action_mask", "step"]
    choice = {"action_mask": np.tile(np.array([1, 0, 1, 1], q_spec.observation["action_mask"].dtype), (6, 1)),
              "step": np.linspace(0, 1, 6, dtype=np.float32)[:, None]}
    (q_values,) = q_session.run(None, choice)
    expected_q = q_policy({k: torch.from_numpy(v) for k, v in choice.items()}).detach().numpy()
    np.testing.assert_allclose(q_values, expected_q, atol=1e-5)  # an invalid action's: the lowest float


def test_a_run_dir_without_a_checkpoint_is_refused_in_one_line(tmp_path):
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        export(tmp_path, "onnx")
    result = run_cli_module("rltrain.export", str(tmp_path), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1 and "holds no checkpoint" in result.stderr


def run_cli_module(module: str, *args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_command_writes_the_file_into_the_run_dir(trained):
    run_dir = trained("ppo_discrete")
    result = run_cli_module("rltrain.export", str(run_dir), "--format", "torchscript", cwd=run_dir)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == str(run_dir / "policy.pt") and (run_dir / "policy.pt").is_file()



def test_a_part_onnx_cannot_express_is_named_with_the_format_that_can(tmp_path):
    run_dir = tmp_path / "run"
    build(make_config("algo.network._target_=tests.policies_for_tests.RunningMaxActorCritic",
                      "trainer.total_frames=512", *SHORT), run_dir=run_dir).fit()
    result = run_cli_module("rltrain.export", str(run_dir), cwd=tmp_path)
    assert result.returncode == 2 and result.stderr.count("\n") == 1, result.stderr
    assert "onnx cannot express the operator aten::cummax in RunningMaxActorCritic's RunningMax at " \
           "algo.network's actor.0" in result.stderr and "try --format torchscript" in result.stderr
    assert not (run_dir / "policy.onnx").exists()
    assert run_cli_module("rltrain.export", str(run_dir), "--format", "torchscript", cwd=tmp_path).returncode == 0


def test_the_docs_example_runs_an_exported_file_as_written(trained, tmp_path):
    # docs/export.md's python block, in a dir where runs/cartpole holds an exported CartPole policy
    text = (ROOT / "docs" / "export.md").read_text()
    block = text.split("<!-- tested:")[1].split("```python\n")[1].split("```")[0]
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "cartpole").symlink_to(trained("ppo_discrete"))
    export(tmp_path / "runs" / "cartpole", "onnx")
    result = subprocess.run([sys.executable, "-c", block], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "[('observation', ['batch', 4], 'tensor(float)')]" in result.stdout
    assert float(result.stdout.split("return")[-1]) >= 9  # an episode ran to its end
