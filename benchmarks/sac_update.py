"""One SAC gradient update (batch 256, 256x256 MLPs, actor + twin critics + alpha + target update):
rltrain's SAC against TorchRL's SACLoss + Adam + SoftUpdate on the same sizes, side by side.

TorchRL needs its own environment (it pins another tensordict):
    python -m venv /tmp/trl && /tmp/trl/bin/pip install torch==2.13.0 torchrl==0.14.1
    python benchmarks/sac_update.py --torchrl-python /tmp/trl/bin/python [--threads 1 2]

Each measurement runs in a fresh process; the rounds alternate between the two.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

OBS, ACT, BATCH, HIDDEN = 17, 6, 256, [256, 256]  # HalfCheetah's sizes


def time_steps(step, n: int = 200) -> float:
    for _ in range(20):
        step()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def measure_rltrain() -> float:
    import numpy as np
    import torch
    from tensordict import TensorDict

    from rltrain.algos import SAC, SquashedGaussianActor
    from rltrain.envs import EnvSpec

    spec = EnvSpec("bench", (OBS,), (ACT,), None, -np.ones(ACT, np.float32), np.ones(ACT, np.float32), None)
    sac = SAC(SquashedGaussianActor(spec, hidden_sizes=HIDDEN), total_frames=1, warmup_frames=0, batch_size=BATCH,
              critic_hidden_sizes=HIDDEN, lr=3e-4, critic_lr=3e-4)
    n = 10_000
    sac.buffer.extend(TensorDict({"observation": torch.randn(n, OBS), "action": torch.rand(n, ACT) * 2 - 1,
                                  "reward": torch.randn(n), "terminated": torch.zeros(n, dtype=torch.bool),
                                  "next": {"observation": torch.randn(n, OBS)}}, batch_size=[n]))
    return time_steps(sac._step)


def measure_torchrl() -> float:
    import torch
    from tensordict import TensorDict
    from tensordict.nn import NormalParamExtractor, TensorDictModule
    from torch import nn
    from torchrl.data import Bounded
    from torchrl.modules import MLP, ProbabilisticActor, TanhNormal, ValueOperator
    from torchrl.objectives import SACLoss, SoftUpdate

    spec = Bounded(low=-1.0, high=1.0, shape=(ACT,))
    actor_net = nn.Sequential(MLP(in_features=OBS, out_features=2 * ACT, num_cells=HIDDEN, activation_class=nn.ReLU),
                              NormalParamExtractor())
    actor = ProbabilisticActor(TensorDictModule(actor_net, in_keys=["observation"], out_keys=["loc", "scale"]),
                               in_keys=["loc", "scale"], distribution_class=TanhNormal, spec=spec,
                               distribution_kwargs={"low": -1.0, "high": 1.0})
    qnet = ValueOperator(MLP(in_features=OBS + ACT, out_features=1, num_cells=HIDDEN, activation_class=nn.ReLU),
                         in_keys=["observation", "action"])
    loss = SACLoss(actor_network=actor, qvalue_network=qnet, num_qvalue_nets=2, action_spec=spec)
    loss.make_value_estimator(gamma=0.99)
    updater = SoftUpdate(loss, tau=0.005)
    optimizer = torch.optim.Adam(loss.parameters(), lr=3e-4)
    n = 10_000
    data = TensorDict({"observation": torch.randn(n, OBS), "action": torch.rand(n, ACT) * 2 - 1,
                       "next": {"observation": torch.randn(n, OBS), "reward": torch.randn(n, 1),
                                "done": torch.zeros(n, 1, dtype=torch.bool),
                                "terminated": torch.zeros(n, 1, dtype=torch.bool)}}, batch_size=[n])

    def step():
        batch = data[torch.randint(n, (BATCH,))]
        out = loss(batch)
        total = out["loss_actor"] + out["loss_qvalue"] + out["loss_alpha"]
        optimizer.zero_grad(set_to_none=True)
        total.backward()
        optimizer.step()
        updater.step()

    return time_steps(step)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--torchrl-python", default=None, help="a Python with torchrl installed")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--measure", choices=["rltrain", "torchrl"], help=argparse.SUPPRESS)
    parser.add_argument("--num-threads", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.measure:
        import torch

        torch.set_num_threads(args.num_threads)
        print(json.dumps({"ms": measure_rltrain() if args.measure == "rltrain" else measure_torchrl()}))
        return
    root = Path(__file__).resolve().parent.parent
    pythons = {"rltrain": sys.executable}
    if args.torchrl_python:
        pythons["torchrl"] = args.torchrl_python
    print(f"\nOne SAC gradient update, batch {BATCH}, {HIDDEN} MLPs, obs {OBS}, action {ACT} (median ms)")
    for threads in args.threads:
        results = {name: [] for name in pythons}
        for _ in range(args.rounds):
            for name, python in pythons.items():
                out = subprocess.run([python, str(Path(__file__).resolve()), f"--measure={name}",
                                      f"--num-threads={threads}"], cwd=root, check=True, capture_output=True,
                                     text=True, env={"PYTHONPATH": str(root), "PATH": ""}).stdout
                results[name].append(json.loads(out.strip().splitlines()[-1])["ms"])
        row = {name: min(v) for name, v in results.items()}
        line = f"  threads {threads}: " + "  ".join(f"{name} {ms:.2f} ms" for name, ms in row.items())
        if "torchrl" in row:
            line += f"  -> rltrain is {row['torchrl'] / row['rltrain']:.2f}x faster (target >= 2x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
