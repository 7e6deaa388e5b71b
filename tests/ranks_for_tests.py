"""One PPO update on a fixed global batch, as the learner-rank tests run it: ``python -m tests.ranks_for_tests
OUT`` in one process, or under torchrun on N data-parallel ranks (``strategy=ddp``), each rank on its share
of the env columns. The weights after the update and its metrics (averaged over the ranks, as the trainer
does) go to OUT."""

from __future__ import annotations

import sys

import torch
from tensordict import TensorDict

from rltrain.algos import PPO, ActorCritic
from rltrain.envs import make_envs
from rltrain.process_groups import exit_without_teardown
from rltrain.strategies import DDP, Single

STEPS, ENVS = 16, 8


def global_batch(policy: ActorCritic) -> TensorDict:
    """A [STEPS, ENVS] CartPole-shaped batch, the same on every rank (a generator of its own)."""
    g = torch.Generator().manual_seed(7)
    obs = torch.randn(STEPS + 1, ENVS, 4, generator=g) * torch.tensor([1.0, 2.0, 0.2, 2.0])
    action = torch.randint(0, 2, (STEPS, ENVS), generator=g)
    done = torch.rand(STEPS, ENVS, generator=g) < 0.08
    with torch.no_grad():
        log_prob = policy.evaluate(obs[:-1].flatten(0, 1), action.flatten())[0].view(STEPS, ENVS)
    return TensorDict({"observation": obs[:-1], "action": action, "log_prob": log_prob,
                       "reward": torch.rand(STEPS, ENVS, generator=g) + 0.5, "terminated": done, "done": done,
                       ("next", "observation"): obs[1:]}, batch_size=[STEPS, ENVS])


def main(out: str) -> None:
    strategy = DDP(timeout_s=60) if "WORLD_SIZE" in __import__("os").environ else Single()
    torch.manual_seed(0)
    env = make_envs("CartPole-v1")
    policy = ActorCritic(env.spec, hidden_sizes=(32, 32), normalize_obs=True)
    env.close()
    algo = PPO(policy, total_frames=10_000, strategy=strategy, epochs=4, minibatch_size=STEPS * ENVS,
               normalize_reward=True, target_kl=1.0)
    share = ENVS // strategy.size
    batch = global_batch(policy)[:, strategy.rank * share:(strategy.rank + 1) * share]
    metrics = algo.update(batch)
    metrics = {k: sum(m[k] for m in strategy.gather(metrics)) / strategy.size for k in metrics}
    if strategy.is_main:
        torch.save({"weights": policy.state_dict(), "metrics": metrics}, out)
    strategy.close()
    if strategy.size > 1:  # as rltrain's own ranks end (its cli): see process_groups.exit_without_teardown
        exit_without_teardown(0)


if __name__ == "__main__":
    main(sys.argv[1])
