"""One gradient step of each algorithm's loss (forward, backward, optimizer step) at equal sizes:
rltrain's PPO and SAC updates against TorchRL's ClipPPOLoss and SACLoss with Adam.

PPO: TorchRL's benchmark batch [128, 10] (1,280 samples), obs 8, 4 continuous actions, separate
128x128 tanh actor and critic MLPs, a state-independent log-std, normalized advantages, the global
gradient norm clipped to 0.5. SAC: HalfCheetah's sizes (obs 17, action 6), 256x256 ReLU actor and
twin critics, batches of 128 and 256 from a 10k-frame buffer; critic, actor and alpha losses with
their Adam steps and the target update. Beside the SAC rows: the matmul-only floor of the same
update (its matmul FLOPs at this machine's measured GEMM rate).
"""

from __future__ import annotations

import time

from benchmarks.core import OURS, Goal, Row, Table

NAME, TITLE = "losses", "One gradient step"
PPO_OBS, PPO_ACT, PPO_BATCH, PPO_HIDDEN = 8, 4, (10, 128), [128, 128]
SAC_OBS, SAC_ACT, SAC_HIDDEN, SAC_BUFFER = 17, 6, [256, 256], 10_000


def box_spec(obs: int, act: int):
    import numpy as np

    from rltrain.envs import ActionSpec, EnvSpec, Leaf

    return EnvSpec("bench", Leaf((obs,), "float32", "vector"),
                   ActionSpec("box", (act,), "float32", low=-np.ones(act, np.float32), high=np.ones(act, np.float32)),
                   None)


def rltrain_ppo():
    import torch
    from tensordict import TensorDict

    from rltrain.algos import PPO, ActorCritic

    g = torch.Generator().manual_seed(0)
    steps, envs = PPO_BATCH
    ppo = PPO(ActorCritic(box_spec(PPO_OBS, PPO_ACT), hidden_sizes=PPO_HIDDEN), total_frames=10**9,
              minibatch_size=steps * envs, max_grad_norm=0.5)
    batch = TensorDict({"observation": torch.randn(steps, envs, PPO_OBS, generator=g),
                        "action": torch.randn(steps, envs, PPO_ACT, generator=g),
                        "log_prob": torch.randn(steps, envs, generator=g) - 5,
                        "reward": torch.randn(steps, envs, generator=g),
                        "terminated": torch.zeros(steps, envs, dtype=torch.bool),
                        "done": torch.zeros(steps, envs, dtype=torch.bool),
                        "next": {"observation": torch.randn(steps, envs, PPO_OBS, generator=g)}},
                       batch_size=[steps, envs])
    pending, idx = ppo._prepare(batch), torch.arange(steps * envs)
    return lambda: ppo._step(pending, idx)


def torchrl_ppo():
    import torch
    from tensordict import TensorDict
    from tensordict.nn import AddStateIndependentNormalScale, TensorDictModule
    from torch import nn
    from torchrl.modules import MLP, IndependentNormal, ProbabilisticActor, ValueOperator
    from torchrl.objectives import ClipPPOLoss

    g = torch.Generator().manual_seed(0)
    steps, envs = PPO_BATCH
    actor_net = nn.Sequential(MLP(in_features=PPO_OBS, out_features=PPO_ACT, num_cells=PPO_HIDDEN,
                                  activation_class=nn.Tanh), AddStateIndependentNormalScale(PPO_ACT))
    actor = ProbabilisticActor(TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
                               in_keys=["loc", "scale"], distribution_class=IndependentNormal, return_log_prob=True)
    critic = ValueOperator(MLP(in_features=PPO_OBS, out_features=1, num_cells=PPO_HIDDEN, activation_class=nn.Tanh),
                           in_keys=["observation"])
    loss = ClipPPOLoss(actor, critic, clip_epsilon=0.2, entropy_coeff=0.0, critic_coeff=0.5, loss_critic_type="l2",
                       normalize_advantage=True)
    keys = loss.tensor_keys
    data = TensorDict({"observation": torch.randn(envs, steps, PPO_OBS, generator=g),
                       keys.action: torch.randn(envs, steps, PPO_ACT, generator=g),
                       keys.sample_log_prob: torch.randn(envs, steps, generator=g) - 5,
                       keys.advantage: torch.randn(envs, steps, 1, generator=g),
                       keys.value_target: torch.randn(envs, steps, 1, generator=g)}, batch_size=[envs, steps])
    params = list(loss.parameters())
    optimizer = torch.optim.Adam(params, lr=3e-4, eps=1e-5)

    def step():
        out = loss(data)
        total = sum(v for k, v in out.items() if k.startswith("loss_"))
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()

    return step


def sac_frames(n: int, obs: int, act: int):
    import torch

    g = torch.Generator().manual_seed(0)
    return {"observation": torch.randn(n, obs, generator=g), "action": torch.rand(n, act, generator=g) * 2 - 1,
            "reward": torch.randn(n, generator=g), "terminated": torch.zeros(n, dtype=torch.bool),
            "next_observation": torch.randn(n, obs, generator=g)}


def rltrain_sac(batch: int, obs: int = SAC_OBS, act: int = SAC_ACT):
    from tensordict import TensorDict

    from rltrain.algos import SAC, SquashedGaussianActor

    sac = SAC(SquashedGaussianActor(box_spec(obs, act), hidden_sizes=SAC_HIDDEN), total_frames=1,
              warmup_frames=0, batch_size=batch, critic_hidden_sizes=SAC_HIDDEN, lr=3e-4, critic_lr=3e-4)
    f = sac_frames(SAC_BUFFER, obs, act)
    f["next"] = {"observation": f.pop("next_observation")}
    sac.buffer.extend(TensorDict(f, batch_size=[SAC_BUFFER]))
    return sac._step


def torchrl_sac(batch: int, obs: int = SAC_OBS, act: int = SAC_ACT):
    import torch
    from tensordict import TensorDict
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torch import nn
    from torchrl.data import Bounded
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import SACLoss, SoftUpdate

    spec = Bounded(low=-1.0, high=1.0, shape=(act,))
    actor_net = nn.Sequential(MLP(in_features=obs, out_features=2 * act, num_cells=SAC_HIDDEN,
                                  activation_class=nn.ReLU), NormalParamExtractor())
    actor = ProbabilisticActor(TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
                               in_keys=["loc", "scale"], distribution_class=TanhNormal, spec=spec,
                               distribution_kwargs={"low": -1.0, "high": 1.0})
    qnet = ValueOperator(MLP(in_features=obs + act, out_features=1, num_cells=SAC_HIDDEN,
                             activation_class=nn.ReLU), in_keys=["observation", "action"])
    loss = SACLoss(actor_network=actor, qvalue_network=qnet, num_qvalue_nets=2, action_spec=spec)
    loss.make_value_estimator(gamma=0.99)
    updater = SoftUpdate(loss, tau=0.005)
    optimizer = torch.optim.Adam(loss.parameters(), lr=3e-4)
    f, n = sac_frames(SAC_BUFFER, obs, act), SAC_BUFFER
    data = TensorDict({"observation": f["observation"], "action": f["action"],
                       "next": {"observation": f["next_observation"], "reward": f["reward"].unsqueeze(-1),
                                "done": f["terminated"].unsqueeze(-1), "terminated": f["terminated"].unsqueeze(-1)}},
                      batch_size=[n])

    def step():
        sample = data[torch.randint(n, (batch,))]
        out = loss(sample)
        total = out["loss_actor"] + out["loss_qvalue"] + out["loss_alpha"]
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        updater.step()

    return step


def sac_matmul_flops(batch: int, obs: int = SAC_OBS, act: int = SAC_ACT) -> float:
    """FLOPs of the matmuls in one SAC update: forward = 2 * batch * weights per MLP; a backward
    with weight gradients costs two forwards, one without (the critics' in the actor loss) one.
    Critic loss: actor and target twins on the next obs, twins forward and backward; actor loss:
    actor forward and backward, twins forward and input-gradient backward."""
    def weights(sizes):
        return sum(a * b for a, b in zip(sizes, sizes[1:]))

    actor = 2 * batch * weights([obs, *SAC_HIDDEN, 2 * act])
    twins = 2 * 2 * batch * weights([obs + act, *SAC_HIDDEN, 1])
    return (actor + 4 * twins) + (3 * actor + 2 * twins)


def gemm_flops_per_s(size: int = 256, reps: int = 200) -> float:
    """This machine's measured matmul rate at the update's width (in this process's thread count)."""
    import torch

    a, b = torch.randn(size, size), torch.randn(size, size)
    for _ in range(20):
        a @ b
    t0 = time.perf_counter()
    for _ in range(reps):
        a @ b
    return 2 * size**3 * reps / (time.perf_counter() - t0)


def run(ctx) -> list[Table]:
    peers = ["torchrl"] if ctx.peer("torchrl") else []
    table = Table(f"{TITLE} (loss, backward, optimizer): ms, median [p10-p90]", [OURS, *peers],
                  notes=ctx.peer_notes("torchrl"))
    reps = 10 if ctx.quick else 30
    rows = [("PPO, batch [128, 10], 128x128", "ppo", {}),
            *[(f"SAC HalfCheetah sizes, batch {b}, 256x256", "sac", {"batch": b})
              for b in ((256,) if ctx.quick else (128, 256))],
            *([] if ctx.quick else [("SAC Pendulum sizes, batch 256, 256x256", "sac",
                                     {"batch": 256, "obs": 3, "act": 1})])]
    rate = gemm_flops_per_s()
    for label, algo, kwargs in rows:
        cases = {OURS: (f"benchmarks.losses:rltrain_{algo}", kwargs)}
        if peers:
            cases["torchrl"] = (f"benchmarks.losses:torchrl_{algo}", kwargs)
        row = Row(label, ctx.compare(cases, reps=reps, notes=table.notes), target=">= 2x TorchRL",
                  goals=(Goal("torchrl", at_least=2),))
        if algo == "sac":
            flops = sac_matmul_flops(**kwargs)
            row.extra["matmul-only floor"] = (f"{flops / rate * 1e3:.2f} ms ({flops / 1e9:.2f} GFLOP at "
                                              f"{rate / 1e9:.0f} GFLOP/s, measured 256x256 GEMM)")
        table.rows.append(row)
    return [table]
