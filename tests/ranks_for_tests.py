"""One update on a fixed global batch, as the learner-rank tests run it: ``python -m tests.ranks_for_tests
OUT [grpo MODEL_DIR [fsdp]]`` in one process, or under torchrun on N data-parallel ranks (``strategy=ddp``, or
``strategy=fsdp`` with ``fsdp``), each rank on its share: PPO's env columns, or GRPO's prompts (whole groups).
The weights after the update and its metrics (averaged over the ranks, as the trainer does) go to OUT.
``OUT push - fsdp``: what a push from sharded weights copies (``push_snapshot``); ``OUT generate MODEL_DIR fsdp``:
completions of different lengths on each rank (``generate_apart``)."""

from __future__ import annotations

import functools
import multiprocessing
import sys
from pathlib import Path

import torch
from tensordict import TensorDict

from rltrain.algos import GRPO, PPO, ActorCritic
from rltrain.collectors.generation import complete
from rltrain.envs import make_envs
from rltrain.llm.engine import Sampling, TransformersEngine
from rltrain.llm.model import LanguageModel
from rltrain.llm.rewards import Rewards, correct_answer, length_penalty
from rltrain.llm.tasks import ReverseDigits
from rltrain.process_groups import exit_without_teardown
from rltrain.strategies import DDP, FSDP, Single
from rltrain.sync.base import FlatBuffer, named_weights
from rltrain.sync.node_shared import shared_slots

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


PROMPTS, GROUP = 8, 4  # GRPO: 8 prompts of the task, 4 completions each


def grpo(strategy, model_dir: str):
    """GRPO (2 epochs, TIS, a KL penalty, micro-batches of 2 groups) on completions of the tiny model in
    ``model_dir``, sampled and scored the same way on every rank; each rank updates on its share of the groups.
    The length penalty gives random weights' completions rewards that differ within a group."""
    model = LanguageModel(model_dir)
    policy = model.load(meta=strategy.SHARDED and not strategy.is_main)  # as the factory: rank 0's weights, sharded
    engine = TransformersEngine(model.load(), model.tokenizer())
    rows = ReverseDigits(seed=3).take(PROMPTS)
    rewards = Rewards({"correct": correct_answer, "length": functools.partial(length_penalty, max_chars=3)})
    batch = complete(engine, model, rows, GROUP, Sampling(temperature=1.3, max_new_tokens=3), rewards, seed=5)
    algo = GRPO(policy, total_frames=10_000, strategy=strategy, epochs=2, micro_batch_size=2 * GROUP, lr=3e-3,
                kl_coef=0.05)
    share = PROMPTS // strategy.size
    return policy, algo, batch[strategy.rank * share:(strategy.rank + 1) * share]


def main(out: str, algo_name: str = "ppo", model_dir: str = "", strategy_name: str = "ddp") -> None:
    strategy = ({"ddp": DDP, "fsdp": FSDP}[strategy_name](timeout_s=60) if "WORLD_SIZE" in __import__("os").environ
                else Single())
    if algo_name == "grpo":
        policy, algo, batch = grpo(strategy, model_dir)
        finish(strategy, policy, algo.update(batch), out)
        return
    if algo_name == "push":
        push_snapshot(strategy, out)
        return
    if algo_name == "generate":
        generate_apart(strategy, model_dir, out)
        return
    torch.manual_seed(0)
    env = make_envs("CartPole-v1")
    policy = ActorCritic(env.spec, hidden_sizes=(32, 32), normalize_obs=True)
    env.close()
    algo = PPO(policy, total_frames=10_000, strategy=strategy, epochs=4, minibatch_size=STEPS * ENVS,
               normalize_reward=True, target_kl=1e-3)  # the KL after epochs 2-4: 4e-4, 1.8e-3, 4.4e-3
    share = ENVS // strategy.size
    batch = global_batch(policy)[:, strategy.rank * share:(strategy.rank + 1) * share]
    finish(strategy, policy, algo.update(batch), out)


def push_snapshot(strategy, out: str) -> None:
    """What a push from sharded weights copies, beside the weights made whole: into a rank's own snapshot (as on
    several machines: rows the ranks divide evenly gathered straight into it, rows they do not, 5 over 2 ranks,
    by DTensor's own gather), and into the slots the ranks of one machine share (every rank writes its rows),
    as every rank reads them; what a process spawned by the last rank writes into a shared slot, as rank 0
    reads it; the slot files left in /dev/shm."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 5))
    whole = {k: v.clone() for k, v in named_weights(module).items()}
    strategy.wrap(module)
    snapshot = FlatBuffer.like(module, shared=False)
    snapshot.copy_from(named_weights(module))
    slots = shared_slots(named_weights(module), 2, pinned=False)
    slots[1].copy_from(named_weights(module))
    shared = strategy.gather_to_main({k: v.clone() for k, v in slots[1].views.items()})
    if strategy.rank == strategy.size - 1:
        child = multiprocessing.get_context("spawn").Process(target=_fill, args=(slots[0], "1.bias", 7.0))
        child.start()
        child.join(60)
    strategy.gather(None)  # (the child has written)
    if strategy.is_main:
        torch.save({"whole": whole, "pushed": dict(snapshot.views), "shared": shared,
                    "slots": type(slots[0]).__name__, "written_by_child": slots[0].views["1.bias"].clone(),
                    "left": sorted(p.name for p in Path("/dev/shm").glob("rltrain-slots-*"))}, out)
    finish(strategy, None, {}, None)


def _fill(slot: FlatBuffer, name: str, value: float) -> None:
    slot.views[name].fill_(value)


def generate_apart(strategy, model_dir: str, out: str) -> None:
    """Greedy completions through the sharded model, rank 0's 2 tokens long and rank 1's 6: each of rank 0's
    forward passes must be matched by rank 1's until rank 1's completions have ended."""
    model = LanguageModel(model_dir)
    policy = model.load(meta=strategy.SHARDED and not strategy.is_main)
    strategy.wrap(policy)
    prompts = [row["prompt"] for row in ReverseDigits(seed=3).take(2)]
    longest = 2 if strategy.rank == 0 else 6
    generated = TransformersEngine(policy, model.tokenizer()).generate(prompts, 1, Sampling(max_new_tokens=longest,
                                                                                            greedy=True))
    ranks = strategy.gather(generated.completion_ids.tolist())  # a collective after it: the ranks in step again
    if strategy.is_main:
        torch.save({"ranks": ranks}, out)
    finish(strategy, None, {}, None)


def finish(strategy, policy, metrics: dict, out: str | None) -> None:
    metrics = {k: sum(m[k] for m in strategy.gather(metrics)) / strategy.size for k in metrics}
    weights = strategy.weights(policy) if policy is not None else None  # (sharded: gathered whole on rank 0)
    if strategy.is_main and out is not None:
        torch.save({"weights": weights, "metrics": metrics}, out)
    strategy.close()
    if strategy.size > 1:  # as rltrain's own ranks end (its cli): see process_groups.exit_without_teardown
        exit_without_teardown(0)


if __name__ == "__main__":
    main(*sys.argv[1:])
