"""A CUDA learner: compiled steps replayed as CUDA graphs compute what eager steps do (skipped steps
counted too), batches and pushes cross between host and GPU intact, and a run's checkpoint moves
between the GPU and the CPU. These need a GPU: ``bash benchmarks/device_check.sh`` runs them on the
device machine (torch sees no CUDA device here, so pytest skips them)."""

from __future__ import annotations

import json

import pytest
import torch

from rltrain.algos import PPO, ActorCritic
from rltrain.device import to_learner
from rltrain.sync import SharedMemSync
from rltrain.sync.base import named_weights
from tests.conftest import run_cli
from tests.test_compile import assert_same, ppo_batch, sac, weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: device_check.sh")
CUDA = torch.device("cuda")


def test_graphed_ppo_updates_match_eager_ones_on_the_gpu():
    runs = {}
    for on in (False, True):
        torch.manual_seed(0)
        ppo = PPO(ActorCritic(_box(), hidden_sizes=[64, 64]).to(CUDA), total_frames=8192, device=CUDA,
                  minibatch_size=192, epochs=4, compile=on, cuda_graph=on)
        metrics = [ppo.update(ppo_batch(k)) for k in range(3)]  # graphs are captured after 3 warm-up steps
        runs[on] = metrics, weights(ppo.policy)
    for graphed, eager in zip(runs[True][0], runs[False][0]):
        for key in ("loss/policy", "loss/value", "ppo/approx_kl", "ppo/lr"):
            assert graphed[key] == pytest.approx(eager[key], rel=1e-3, abs=1e-5), key
    assert_same(runs[True][1], runs[False][1])


def _box():
    from benchmarks.losses import box_spec

    return box_spec(17, 6)


def test_graphed_sac_steps_match_eager_ones_and_count_the_steps_they_skip():
    runs = {}
    for on in (False, True):
        agent = sac(on, CUDA, width=256, cuda_graph=on)
        torch.manual_seed(1)
        metrics = torch.stack([agent._step() for _ in range(8)])
        assert agent.guard.report() == 0
        runs[on] = metrics, weights(agent.policy, agent.q, agent.q_target)
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-3, atol=1e-4)
    assert_same(runs[True][1], runs[False][1])

    agent = sac(True, CUDA, width=256, cuda_graph=True, nonfinite="skip")
    for _ in range(5):
        agent._step()  # warmed up and captured
    before = weights(agent.q)
    agent.buffer.storage["reward"].fill_(float("nan"))
    for _ in range(3):
        agent._step()
    assert agent.guard.report() == 3  # each replayed critic step was flagged, counted, and skipped
    assert_same(weights(agent.q), before)


def test_a_batch_reaches_the_gpu_whole_through_pinned_memory():
    batch = ppo_batch(0)
    moved = to_learner(batch, ["observation", "reward", ("next", "observation")], CUDA)
    assert moved.device == CUDA and set(moved.keys(True, True)) == {"observation", "reward", ("next", "observation")}
    torch.testing.assert_close(moved["next", "observation"].cpu(), batch["next", "observation"])


def test_a_gpu_learners_push_reaches_a_cpu_collector_exactly():
    learner = ActorCritic(_box(), hidden_sizes=[256, 256], normalize_obs=True).to(CUDA)
    scheme = SharedMemSync()
    sender = scheme.sender(learner)
    assert scheme._shared.slots[0].buffer.is_pinned()  # page-locked shared memory: one fast transfer per push
    collector_policy = ActorCritic(_box(), hidden_sizes=[256, 256], normalize_obs=True)
    receiver = scheme.receiver()
    receiver.connect(collector_policy)
    with torch.no_grad():
        for p in learner.parameters():
            p.add_(torch.randn_like(p))
    assert sender.push() == 1 and receiver.poll()
    for name, tensor in named_weights(learner).items():
        torch.testing.assert_close(named_weights(collector_policy)[name], tensor.cpu(), rtol=0, atol=0)
    receiver.close()
    sender.close()


@pytest.mark.parametrize("algo", ["ppo", "sac", "dqn"])
def test_a_gpu_checkpoint_resumes_on_the_cpu_and_back(algo, tmp_path):
    args = ["trainer.stop_at_return=null", "hydra.run.dir=run"]
    args += {"ppo": [], "sac": ["algo=sac", "env=pendulum", "algo.warmup_frames=256"],
             # DQN's compiled, graphed step; the eval acts epsilon-greedily on the GPU at each env's own rate
             "dqn": ["algo=dqn", "algo.warmup_frames=256", "algo.exploration=per_env",
                     "hooks.eval.deterministic=false"]}[algo]
    for device, frames in (("cuda", 1024), ("cpu", 2048), ("cuda", 3072)):
        result = run_cli(*args, f"device={device}", f"trainer.total_frames={frames}", "hooks.timing.cuda_sync=true",
                         *(["resume=run"] if frames > 1024 else []), cwd=tmp_path, timeout=900)
        assert result.returncode == 0, result.stderr
        summary = json.loads((tmp_path / "run" / "summary.json").read_text())
        assert summary["status"] == "completed" and summary["frames"] == frames
        assert summary["time"]["update"] > 0 and sum(summary["time"].values()) == pytest.approx(
            summary["wall_time_s"], rel=0.01)  # the phases, synchronized, still add up to the wall time


def test_a_language_model_learns_with_its_engine_on_the_gpu_and_each_push_reaches_it(tmp_path):
    from rltrain import build
    from tests.conftest import make_config
    from tests.test_grpo import ONE_TOKEN

    trainer = build(make_config(*ONE_TOKEN, "device=cuda"), run_dir=tmp_path / "run")
    engine = trainer.collector.engine.model
    assert engine.device.type == "cuda" and engine.lm_head.weight is engine.model.embed_tokens.weight
    summary = trainer.fit()
    assert summary["status"] == "completed" and summary["eval_return"] > 0.9
    # The last push (after the last update, which no batch followed) reaches the engine whole.
    assert trainer.collector.engine.receiver.poll()
    learner = named_weights(trainer.algo.policy)
    assert all(torch.equal(t, learner[name]) for name, t in named_weights(engine).items())
