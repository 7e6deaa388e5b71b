"""The learner on ``--device`` (a GPU on the device machine; the CPU for a dry run and for what
``algo.compile`` does there): update steps eager, compiled and (on CUDA) replayed as CUDA graphs,
beside a plain eager CleanRL-style anchor; a GPU learner's weight push beside the pinned copy;
SAC HalfCheetah end to end on this device beside the same run on the CPU.

Update steps, each at its recipe's sizes: SAC (HalfCheetah's obs 17 / action 6, 256x256 actor and
twin critics, batch 256: critics, actor, temperature and the Polyak step); PPO minibatch steps of
64 samples with 64x64 tanh networks (CleanRL's ppo_continuous_action) and with 256x256 ReLU ones
(``+recipe=ppo_halfcheetah``); and a whole PPO update of the default CartPole batch (512 frames,
10 epochs of two 256-sample minibatches, GAE and the metrics' one host read included), whose
updates/s is the figure a user sees. The anchors are CleanRL's own update code in eager PyTorch
(torch.distributions, separate Q networks, foreach Adam, the per-step ``.item()`` reads and the
per-parameter Polyak loop CleanRL has). Every step is timed until the device is idle again.

Push: ``sync=shared_mem`` from a learner on the device to 2 CPU worker processes, beside one
page-locked device-to-host copy of the same bytes (on the CPU: a memcpy): until ``push`` returns
(what the learner waits for) and until both workers hold the new version (they look every 0.2 ms,
as an async collector's workers do between env steps), both timed on the same pushes.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.core import ROOT, Goal, Row, Stat, Table
from benchmarks.losses import box_spec, sac_frames

NAME, TITLE = "learner", "The learner on the device"
ANCHOR, EAGER, COMPILED = "CleanRL eager", "rltrain eager", "rltrain compiled"
SAC_OBS, SAC_ACT, SAC_BATCH = 17, 6, 256
PPO_OBS, PPO_ACT = 17, 6
E2E_RECIPE = "sac_halfcheetah"
# The end-to-end dry run's budget (--quick): 100 gradient steps after its warm-up (4 per 4-frame batch).
DRY_RUN_FRAMES, DRY_RUN_WARMUP = 400, 300


def _sync(device):
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _timed(step, device):
    """``step`` followed by waiting for the device, so each sample is the step's whole time."""
    def run():
        out = step()
        _sync(device)
        return out

    return run


def sac_step(device: str, mode: str):
    """One SAC gradient step: ``mode`` eager or compiled (compiled on CUDA: also a CUDA graph)."""
    from tensordict import TensorDict

    from rltrain.algos import SAC, SquashedGaussianActor

    on = mode == "compiled"
    sac = SAC(SquashedGaussianActor(box_spec(SAC_OBS, SAC_ACT), hidden_sizes=[256, 256]).to(device), total_frames=1,
              device=device, warmup_frames=0, batch_size=SAC_BATCH, lr=3e-4, critic_lr=1e-3, compile=on,
              cuda_graph=on and device.startswith("cuda"))
    f = sac_frames(10_000, SAC_OBS, SAC_ACT)
    f["next"] = {"observation": f.pop("next_observation")}
    sac.buffer.extend(TensorDict(f, batch_size=[10_000]))
    return _timed(sac._step, device)


def cleanrl_sac_step(device: str):
    """CleanRL's sac_continuous_action update (one critic, actor and alpha step, then the targets),
    written as it writes it, on a replay buffer already on the device."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class SoftQ(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2, self.fc3 = nn.Linear(SAC_OBS + SAC_ACT, 256), nn.Linear(256, 256), nn.Linear(256, 1)

        def forward(self, x, a):
            x = F.relu(self.fc1(torch.cat([x, a], 1)))
            return self.fc3(F.relu(self.fc2(x)))

    class Actor(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(SAC_OBS, 256), nn.Linear(256, 256)
            self.fc_mean, self.fc_logstd = nn.Linear(256, SAC_ACT), nn.Linear(256, SAC_ACT)

        def get_action(self, x):
            x = F.relu(self.fc2(F.relu(self.fc1(x))))
            mean, log_std = self.fc_mean(x), torch.tanh(self.fc_logstd(x))
            log_std = -5 + 0.5 * (2 - -5) * (log_std + 1)
            normal = torch.distributions.Normal(mean, log_std.exp())
            x_t = normal.rsample()
            y_t = torch.tanh(x_t)
            log_prob = normal.log_prob(x_t) - torch.log(1 - y_t.pow(2) + 1e-6)
            return y_t, log_prob.sum(1, keepdim=True)

    actor, qf1, qf2, qf1_t, qf2_t = Actor().to(device), *(SoftQ().to(device) for _ in range(4))
    qf1_t.load_state_dict(qf1.state_dict())
    qf2_t.load_state_dict(qf2.state_dict())
    q_optimizer = torch.optim.Adam(list(qf1.parameters()) + list(qf2.parameters()), lr=1e-3)
    actor_optimizer = torch.optim.Adam(actor.parameters(), lr=3e-4)
    log_alpha = torch.zeros(1, requires_grad=True, device=device)
    a_optimizer = torch.optim.Adam([log_alpha], lr=1e-3)
    alpha, target_entropy, gamma, tau = log_alpha.exp().item(), -float(SAC_ACT), 0.99, 0.005
    f = {k: v.to(device) for k, v in sac_frames(10_000, SAC_OBS, SAC_ACT).items()}

    def step():
        nonlocal alpha
        idx = torch.randint(10_000, (SAC_BATCH,), device=device)
        obs, act, next_obs = f["observation"][idx], f["action"][idx], f["next_observation"][idx]
        rew, done = f["reward"][idx], f["terminated"][idx].float()
        with torch.no_grad():
            next_a, next_logp = actor.get_action(next_obs)
            min_next = torch.min(qf1_t(next_obs, next_a), qf2_t(next_obs, next_a)) - alpha * next_logp
            next_q = rew + (1 - done) * gamma * min_next.view(-1)
        qf_loss = F.mse_loss(qf1(obs, act).view(-1), next_q) + F.mse_loss(qf2(obs, act).view(-1), next_q)
        q_optimizer.zero_grad()
        qf_loss.backward()
        q_optimizer.step()
        pi, log_pi = actor.get_action(obs)
        actor_loss = ((alpha * log_pi) - torch.min(qf1(obs, pi), qf2(obs, pi))).mean()
        actor_optimizer.zero_grad()
        actor_loss.backward()
        actor_optimizer.step()
        with torch.no_grad():
            _, log_pi = actor.get_action(obs)
        alpha_loss = (-log_alpha.exp() * (log_pi + target_entropy)).mean()
        a_optimizer.zero_grad()
        alpha_loss.backward()
        a_optimizer.step()
        alpha = log_alpha.exp().item()
        for net, target in ((qf1, qf1_t), (qf2, qf2_t)):
            for param, target_param in zip(net.parameters(), target.parameters()):
                target_param.data.copy_(tau * param.data + (1 - tau) * target_param.data)

    return _timed(step, device)


def _ppo_batch(device: str, steps: int, envs: int, spec):
    import torch
    from tensordict import TensorDict

    g = torch.Generator().manual_seed(0)
    discrete = spec.action.kind == "discrete"
    obs_dim = spec.observation.shape[0]
    action = (torch.randint(2, (steps, envs), generator=g) if discrete
              else torch.randn(steps, envs, spec.action.shape[0], generator=g))
    return TensorDict({"observation": torch.randn(steps, envs, obs_dim, generator=g), "action": action,
                       "log_prob": torch.randn(steps, envs, generator=g) - 1,
                       "reward": torch.randn(steps, envs, generator=g),
                       "terminated": torch.zeros(steps, envs, dtype=torch.bool),
                       "done": torch.rand(steps, envs, generator=g) < 0.02,
                       "next": {"observation": torch.randn(steps, envs, obs_dim, generator=g)}},
                      batch_size=[steps, envs])


def _ppo(device: str, mode: str, spec, hidden: list[int], activation: str, minibatch: int):
    from rltrain.algos import PPO, ActorCritic

    on = mode == "compiled"
    policy = ActorCritic(spec, hidden_sizes=hidden, activation=activation).to(device)
    return PPO(policy, total_frames=10**9, device=device, minibatch_size=minibatch, compile=on,
               cuda_graph=on and device.startswith("cuda"))


def ppo_step(device: str, mode: str, minibatch: int, hidden: int, activation: str):
    """One PPO minibatch step (loss, backward, clip, Adam) on a box-action batch."""
    import torch

    ppo = _ppo(device, mode, box_spec(PPO_OBS, PPO_ACT), [hidden, hidden], activation, minibatch)
    pending = ppo._prepare(_ppo_batch(device, 64, 16, box_spec(PPO_OBS, PPO_ACT)))
    perm = torch.randperm(1024, device=device)
    k = [0]

    def step():
        k[0] = (k[0] + 1) % (1024 // minibatch)
        return ppo._step(pending, perm[k[0] * minibatch: (k[0] + 1) * minibatch])

    return _timed(step, device)


def cartpole_spec():
    from rltrain.envs import ActionSpec, EnvSpec, Leaf

    return EnvSpec("CartPole-v1", Leaf((4,), "float32", "vector"), ActionSpec("discrete", (), "int64", nvec=(2,)),
                   475.0)


def ppo_update(device: str, mode: str):
    """A whole PPO update of the default CartPole batch: 512 frames ([32, 16]), 10 epochs of two
    256-sample minibatches, GAE, and the metrics' read."""
    ppo = _ppo(device, mode, cartpole_spec(), [64, 64], "tanh", 256)
    batch = _ppo_batch("cpu", 32, 16, cartpole_spec())
    return _timed(lambda: ppo.update(batch), device)


def cleanrl_ppo_step(device: str, minibatch: int, hidden: int, activation: str):
    """CleanRL's ppo_continuous_action minibatch step: the Normal distribution, approx_kl and the
    clip fraction read with ``.item()`` each minibatch, advantages normalized, foreach Adam."""
    import torch
    from torch import nn

    act_cls = {"tanh": nn.Tanh, "relu": nn.ReLU}[activation]

    def mlp(out: int, std: float) -> nn.Sequential:
        layers = [nn.Linear(PPO_OBS, hidden), act_cls(), nn.Linear(hidden, hidden), act_cls(), nn.Linear(hidden, out)]
        for layer in layers[::2]:
            nn.init.orthogonal_(layer.weight, math.sqrt(2))
            nn.init.zeros_(layer.bias)
        nn.init.orthogonal_(layers[-1].weight, std)
        return nn.Sequential(*layers)

    critic, actor_mean = mlp(1, 1.0).to(device), mlp(PPO_ACT, 0.01).to(device)
    actor_logstd = nn.Parameter(torch.zeros(1, PPO_ACT, device=device))
    params = [*critic.parameters(), *actor_mean.parameters(), actor_logstd]
    optimizer = torch.optim.Adam(params, lr=3e-4, eps=1e-5)
    n = 1024
    g = torch.Generator().manual_seed(0)
    b = {"obs": torch.randn(n, PPO_OBS, generator=g), "actions": torch.randn(n, PPO_ACT, generator=g),
         "logprobs": torch.randn(n, generator=g) - 5, "advantages": torch.randn(n, generator=g),
         "returns": torch.randn(n, generator=g), "values": torch.randn(n, generator=g)}
    b = {k: v.to(device) for k, v in b.items()}
    perm, k, clipfracs = torch.randperm(n, device=device), [0], []

    def step():
        k[0] = (k[0] + 1) % (n // minibatch)
        mb = perm[k[0] * minibatch: (k[0] + 1) * minibatch]
        mean = actor_mean(b["obs"][mb])
        probs = torch.distributions.Normal(mean, torch.exp(actor_logstd.expand_as(mean)))
        newlogprob, entropy = probs.log_prob(b["actions"][mb]).sum(1), probs.entropy().sum(1)
        newvalue = critic(b["obs"][mb])
        logratio = newlogprob - b["logprobs"][mb]
        ratio = logratio.exp()
        with torch.no_grad():
            approx_kl = ((ratio - 1) - logratio).mean()
            clipfracs.append(((ratio - 1.0).abs() > 0.2).float().mean().item())
        mb_adv = b["advantages"][mb]
        mb_adv = (mb_adv - mb_adv.mean()) / (mb_adv.std() + 1e-8)
        pg_loss = torch.max(-mb_adv * ratio, -mb_adv * torch.clamp(ratio, 0.8, 1.2)).mean()
        v_loss = 0.5 * ((newvalue.view(-1) - b["returns"][mb]) ** 2).mean()
        loss = pg_loss - 0.0 * entropy.mean() + v_loss * 0.5
        optimizer.zero_grad()
        loss.backward()
        nn.utils.clip_grad_norm_(params, 0.5)
        optimizer.step()
        del clipfracs[:]
        return approx_kl.item()

    return _timed(step, device)


def _update_table(ctx, device: str, compiled_label: str) -> Table:
    """With --quick on the CPU (CI's smoke run) the compiled column is left out: its compiles are
    nearly all of its cost, and tests/test_compile.py checks compiled steps against eager ones."""
    reps = 10 if ctx.quick else 100
    compiling = not (ctx.quick and device == "cpu")
    columns = [ANCHOR, EAGER, compiled_label] if compiling else [ANCHOR, EAGER]
    table = Table(f"Update steps on {device}: ms per step, median [p10-p90] of {ctx.rounds} rounds x {reps}",
                  columns, ratio_to=compiled_label if compiling else EAGER)
    on_gpu = device.startswith("cuda")
    rows = [  # the targets (ms per step of the compiled column) are the GPU's
        ("SAC step, batch 256, 256x256", "benchmarks.learner:sac_step", {},
         ("benchmarks.learner:cleanrl_sac_step", {}), 2 if on_gpu else None),
        ("PPO minibatch step, 64 samples, 64x64 tanh", "benchmarks.learner:ppo_step",
         {"minibatch": 64, "hidden": 64, "activation": "tanh"},
         ("benchmarks.learner:cleanrl_ppo_step", {"minibatch": 64, "hidden": 64, "activation": "tanh"}),
         1 if on_gpu else None),
        ("PPO minibatch step, 64 samples, 256x256 relu (ppo_halfcheetah)", "benchmarks.learner:ppo_step",
         {"minibatch": 64, "hidden": 256, "activation": "relu"},
         ("benchmarks.learner:cleanrl_ppo_step", {"minibatch": 64, "hidden": 256, "activation": "relu"}), None),
        ("PPO update, CartPole's default batch (512 frames, 10 x 2 minibatches of 256)",
         "benchmarks.learner:ppo_update", {}, None, None),
    ]
    for label, ref, kwargs, anchor, ms in rows[:2] if ctx.quick else rows:
        cases = {EAGER: (ref, {"device": device, "mode": "eager", **kwargs})}
        if compiling:
            cases[compiled_label] = (ref, {"device": device, "mode": "compiled", **kwargs})
        if anchor is not None:
            cases[ANCHOR] = (anchor[0], {"device": device, **anchor[1]})
        cells = ctx.compare(cases, reps=reps, warmup=10, notes=table.notes)
        extra = {}
        if ref.endswith("ppo_update"):
            extra = {f"{c} updates/s": f"{1e3 / s.median:,.0f}" for c, s in cells.items() if s}
        table.rows.append(Row(label, cells, target=f"<= {ms} ms" if ms else "", extra=extra,
                              goals=(Goal(compiled_label, at_most=ms, median=True),) if ms else ()))
    table.notes.append("the compiled column's one-time compile (logged by rltrain) is in its warm-up, not here"
                       if compiling else "--quick on the CPU: no compiled column (tests/test_compile.py checks it)")
    return table


def pinned_copy_times(n_params: int, device: str, repeats: int) -> list[float]:
    """ms for one copy of the snapshot's bytes to page-locked host memory (on the CPU: a memcpy)."""
    import torch

    from benchmarks.weight_sync import make_net

    n = sum(t.numel() for t in make_net(n_params).state_dict().values())
    src = torch.randn(n, device=device)
    dst = torch.empty(n, pin_memory=device.startswith("cuda"))
    times = []
    for _ in range(repeats + 2):
        _sync(device)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return times[2:]


def _push_table(ctx, device: str) -> Table:
    from benchmarks.weight_sync import parse_count, push_and_held_times

    floor = "pinned copy" if device.startswith("cuda") else "memcpy"
    pushed, held = "push returns", "both workers hold it"
    repeats = 5 if ctx.quick else 20
    table = Table(f"Push from a learner on {device} to 2 CPU workers (sync=shared_mem): ms until the learner's push "
                  f"returns, and until both workers hold the version (they look every 0.2 ms), median [p10-p90] of "
                  f"{repeats}", [floor, pushed, held], ratio_to=floor, ratio_header="{peer} / floor",
                  ratio_mode="over")
    for text in (["1M"] if ctx.quick else ["1M", "50M"]):
        n = parse_count(text)
        push_ms, held_ms = push_and_held_times("shared_mem", n, 2, repeats, device=device)
        cells = {floor: Stat(pinned_copy_times(n, device, repeats)), pushed: Stat(push_ms), held: Stat(held_ms)}
        on_gpu = device.startswith("cuda")  # the target: what the learner waits for, beside the pinned copy
        table.rows.append(Row(f"{text} params", cells, target=f"{pushed} <= 1.5x" if on_gpu else "",
                              goals=(Goal(pushed, at_most=1.5),) if on_gpu else ()))
    return table


def _e2e_process(device: str, frames: int, tmp: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rltrain", f"+recipe={E2E_RECIPE}", f"device={device}",
           f"hydra.run.dir={tmp}/{device}", f"trainer.total_frames={frames}", "hooks.progress.bar=false",
           "hooks.checkpoint.every=null",
           f"hooks.eval.every={{frames: {max(frames // 4, 1)}}}"]
    if frames == DRY_RUN_FRAMES:  # learning starts within it; one evaluation, at the end
        cmd += [f"algo.warmup_frames={DRY_RUN_WARMUP}", "hooks.eval.every=null", "hooks.eval.episodes=1",
                # one thread, not the recipe's two: on a busy 2-core box two threads wait on each other
                # (2,000 frames at load 5: 268 s with two, 33 s with one)
                "threads=1"]
    # stderr to a file: what a long run prints cannot fill a pipe and stall it.
    with open(f"{tmp}/{device}.err", "w") as err:
        return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)


def _e2e_table(ctx, device: str) -> Table:
    """The recipe on this device and on the CPU, side by side in two processes at once; the CPU one
    is stopped (SIGTERM: it checkpoints and writes its summary) once the device one is done, or at
    its own end, whichever comes first."""
    frames = DRY_RUN_FRAMES if ctx.quick else 100_000
    table = Table(f"+recipe={E2E_RECIPE}, {frames:,} frames, the learner on {device} beside the CPU (envs on the "
                  "CPU in both)", [device, "cpu"] if device != "cpu" else ["cpu"], ratio_to=None)
    with tempfile.TemporaryDirectory() as tmp:
        procs = {column: _e2e_process(column, frames, tmp) for column in table.columns}
        main = procs[table.columns[0]]
        try:
            main.wait(timeout=3600)
        finally:
            for column, proc in procs.items():
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGTERM)
                    try:
                        proc.wait(timeout=120)
                    except subprocess.TimeoutExpired:
                        os.killpg(proc.pid, signal.SIGKILL)
        summaries = {}
        for column in table.columns:
            path = Path(tmp) / column / "summary.json"
            if not path.exists():
                table.notes.append(f"{column}: no summary.json ({Path(tmp, f'{column}.err').read_text()[-500:]})")
                continue
            summaries[column] = json.loads(path.read_text())
    for label, key, unit in (("frames/s", "fps", "frames/s"), ("frames reached", "frames", "frames"),
                             ("eval return (last evaluation)", "eval_return", "return"),
                             ("training return (last 10 episodes)", "train_return", "return"),
                             ("wall time", "wall_time_s", "s")):
        cells = {c: Stat([float(s[key])], unit=unit, higher_is_better=True) if s.get(key) is not None else None
                 for c, s in summaries.items()}
        if any(cells.values()):  # a dry run may end before any episode does: no training return
            table.rows.append(Row(label, cells))
    table.notes += [f"{c}: status {s['status']}" for c, s in summaries.items() if s["status"] != "completed"]
    return table


def run(ctx) -> list[Table]:
    import torch

    device = ctx.device
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError(f"--device {device}, but torch sees no CUDA device")
    torch.set_num_threads(ctx.threads)
    compiled = "rltrain compiled + CUDA graph" if device.startswith("cuda") else COMPILED
    tables = [_update_table(ctx, device, compiled), _push_table(ctx, device)]
    if device != "cpu" or ctx.quick:  # on the CPU, only as a dry run of the device machine's comparison
        tables.append(_e2e_table(ctx, device))
    if device.startswith("cuda"):
        tables[0].notes.append(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    return tables
