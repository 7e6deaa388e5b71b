"""algo.compile: compiled update steps compute what eager ones do; a checkpoint of a compiled run
resumes in an eager one and back; bad settings are refused before anything starts."""

from __future__ import annotations

import json

import pytest
import torch
from tensordict import TensorDict

from benchmarks.losses import box_spec, sac_frames
from rltrain import build
from rltrain.algos import PPO, SAC, ActorCritic, SquashedGaussianActor, optimizers
from rltrain.errors import ConfigError
from tests.conftest import LEARNING_RUN_TIMEOUT_S, learning_check, make_config, run_cli


def ppo_batch(seed: int, steps: int = 32, envs: int = 16) -> TensorDict:
    g = torch.Generator().manual_seed(seed)
    return TensorDict({"observation": torch.randn(steps, envs, 17, generator=g),
                       "action": torch.randn(steps, envs, 6, generator=g),
                       "log_prob": torch.randn(steps, envs, generator=g) - 5,
                       "reward": torch.randn(steps, envs, generator=g),
                       "terminated": torch.rand(steps, envs, generator=g) < 0.02,
                       "done": torch.rand(steps, envs, generator=g) < 0.05,
                       "next": {"observation": torch.randn(steps, envs, 17, generator=g)}}, batch_size=[steps, envs])


def weights(*modules) -> list[torch.Tensor]:
    return [p.detach().clone() for m in modules for p in m.parameters()]


def assert_same(compiled: list[torch.Tensor], eager: list[torch.Tensor]) -> None:
    for c, e in zip(compiled, eager, strict=True):
        torch.testing.assert_close(c, e, rtol=1e-4, atol=1e-5)


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


@pytest.mark.slow
def test_compiled_ppo_updates_match_eager_ones_and_compile_once():
    runs = {}
    for compile in (False, True):
        torch.manual_seed(0)
        # 512 frames in minibatches of 192: the last one (128) runs eagerly rather than compiling again.
        ppo = PPO(ActorCritic(box_spec(17, 6), hidden_sizes=[64, 64]), total_frames=4096, minibatch_size=192,
                  epochs=3, compile=compile)
        metrics = [ppo.update(ppo_batch(1))]
        graphs = compiled_graphs()
        metrics.append(ppo.update(ppo_batch(2)))
        if compile:
            assert compiled_graphs() == graphs, "the second update compiled again"
            assert isinstance(ppo.optimizer.param_groups[0]["lr"], torch.Tensor)  # annealed without recompiling
        runs[compile] = metrics, weights(ppo.policy)
    (compiled, compiled_weights), (eager, eager_weights) = runs[True], runs[False]
    for c, e in zip(compiled, eager):
        assert c.keys() == e.keys()
        assert c["ppo/lr"] == pytest.approx(e["ppo/lr"])
        for key in ("loss/policy", "loss/value", "loss/entropy", "ppo/approx_kl"):
            assert c[key] == pytest.approx(e[key], rel=1e-4, abs=1e-6), key
    assert_same(compiled_weights, eager_weights)


def sac(compile: bool, device: str = "cpu", width: int = 64, **kwargs) -> SAC:
    """A SAC learner (HalfCheetah's sizes) on ``device`` whose replay buffer holds 1,000 frames."""
    torch.manual_seed(0)
    agent = SAC(SquashedGaussianActor(box_spec(17, 6), hidden_sizes=[width, width]).to(device), total_frames=1,
                device=device, warmup_frames=0, batch_size=128, critic_hidden_sizes=[width, width], compile=compile,
                **kwargs)
    f = sac_frames(1000, 17, 6)
    f["next"] = {"observation": f.pop("next_observation")}
    agent.buffer.extend(TensorDict(f, batch_size=[1000]))
    return agent


@pytest.mark.slow
def test_compiled_sac_steps_match_eager_ones():
    runs = {}
    for compile in (False, True):
        agent = sac(compile)
        torch.manual_seed(1)
        metrics = torch.stack([agent._step() for _ in range(6)])
        runs[compile] = metrics, weights(agent.policy, agent.q, agent.q_target) + [agent.log_alpha.detach().clone()]
        assert agent.guard.report() == 0  # the six steps were counted and none was skipped
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-4, atol=1e-5)
    assert_same(runs[True][1], runs[False][1])


def test_an_optimizer_state_loads_across_lr_kinds_and_keeps_this_runs_options():
    """A compiled PPO's Adam holds its annealed lr as a tensor (which compiled steps and CUDA graphs
    read in place); an eager one's is a float; a GPU graph's is capturable. Each loads the others'."""
    params = [torch.nn.Parameter(torch.randn(3))]
    tensor_lr = optimizers.adam(params, 0.1, torch.device("cpu"), graphed=False, lr_tensor=True)
    lr = tensor_lr.param_groups[0]["lr"]
    float_lr = optimizers.adam([torch.nn.Parameter(torch.randn(3))], 0.1, torch.device("cpu"), graphed=False)
    params[0].sum().backward()
    tensor_lr.step()
    optimizers.set_lr(tensor_lr, 0.025)
    assert tensor_lr.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.025)

    saved = tensor_lr.state_dict()
    saved["param_groups"][0]["capturable"] = True  # as a CUDA-graph run on a GPU saves it
    optimizers.load_adam(float_lr, saved)
    group = float_lr.param_groups[0]
    assert group["lr"] == pytest.approx(0.025) and isinstance(group["lr"], float) and group["capturable"] is False
    assert int(float_lr.state[float_lr.param_groups[0]["params"][0]]["step"]) == 1

    optimizers.set_lr(float_lr, 0.05)
    optimizers.load_adam(tensor_lr, float_lr.state_dict())
    assert tensor_lr.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(0.05)


@pytest.mark.parametrize("override, message", [
    ("algo.cuda_graph=true", "algo.cuda_graph=true needs a CUDA learner, but the device is cpu"),
    ("algo.compile=maybe", "algo.compile must be true, false or auto"),
])
def test_compile_settings_that_cannot_work_are_refused_naming_the_key(override, message, tmp_path):
    with pytest.raises(ConfigError, match=message):
        build(make_config("device=cpu", override), run_dir=tmp_path / "run")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
@learning_check
def test_a_compiled_run_on_dict_observations_learns_logs_its_compile_once_and_resumes_eagerly(tmp_path):
    run = ["env.id=tests.toy_envs:GoalCorridor-v0", "env.num_envs=8", "collector.frames_per_batch=256",
           "algo.lr=1e-3", "algo.minibatch_size=64", "algo.gamma=0.95", "trainer.stop_at_return=null"]
    first = run_cli(*run, "algo.compile=true", "trainer.total_frames=12288", "hydra.run.dir=run", cwd=tmp_path,
                    timeout=LEARNING_RUN_TIMEOUT_S)
    assert first.returncode == 0, first.stderr
    log = (tmp_path / "run" / "cli.log").read_text()
    assert log.count("algo.compile: PPO's minibatch step compiled in") == 1
    resumed = run_cli(*run, "algo.compile=false", "trainer.total_frames=20480", "resume=run", cwd=tmp_path,
                      timeout=LEARNING_RUN_TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr
    assert "changed: algo.compile: True -> False" in (tmp_path / "run" / "cli.log").read_text()
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["frames"] == 20480 and summary["eval_return"] >= 0.6  # random: about 0.1 (tests/test_spaces.py)
