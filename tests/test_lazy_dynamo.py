"""A run that compiles nothing never imports torch._dynamo, and compiling later still sees
tensordict's marks and torch's optimizer wrappers (rltrain/lazy_dynamo.py); only processes that
rltrain owns (the CLI, worker processes) get that: ``import rltrain`` changes nothing in torch."""

from __future__ import annotations

import functools
import subprocess
import sys
import textwrap

from rltrain import lazy_dynamo
from rltrain.envs import GymnasiumBatchedEnv
from tests.conftest import ROOT

SCRIPT = textwrap.dedent("""
    import sys
    from rltrain import lazy_dynamo
    lazy_dynamo.install()  # as rltrain/cli.py does, before torch and tensordict
    import torch
    from tensordict import TensorDict
    from rltrain.algos import PPO, ActorCritic
    from rltrain.envs import GymnasiumBatchedEnv

    env = GymnasiumBatchedEnv("CartPole-v1", num_envs=2, seed=0)
    policy = ActorCritic(env.spec)
    ppo = PPO(policy, total_frames=1000, minibatch_size=8, epochs=2)
    twin = ActorCritic(env.spec)
    twin.load_state_dict(policy.state_dict())
    twin_ppo = PPO(twin, total_frames=1000, minibatch_size=8, epochs=2)
    g = torch.Generator().manual_seed(0)
    batch = TensorDict({"observation": torch.randn(8, 2, 4, generator=g), "action": torch.randint(2, (8, 2)),
                        "log_prob": torch.full((8, 2), -0.7), "reward": torch.ones(8, 2),
                        "terminated": torch.zeros(8, 2, dtype=torch.bool), "done": torch.zeros(8, 2, dtype=torch.bool),
                        "next": {"observation": torch.randn(8, 2, 4, generator=g)}}, batch_size=[8, 2])
    torch.manual_seed(1)
    ppo.update(batch)
    ppo.optimizer.load_state_dict(ppo.optimizer.state_dict())
    assert "torch._dynamo" not in sys.modules, "an update imported torch._dynamo"

    import torch._dynamo  # what torch.compile does first
    from torch._dynamo import trace_rules
    import tensordict.base, tensordict.utils
    assert tensordict.utils._lock_warn._dynamo_marked_constant
    assert id(tensordict.base._foreach_copy_compiled) in trace_rules._allowed_callable_ids
    torch.manual_seed(1)
    twin_ppo.update(batch)  # the same update through torch's own wrappers, graph breaks and all
    for a, b in zip(policy.parameters(), twin.parameters()):
        assert torch.equal(a, b)
    from rltrain.lazy_dynamo import _UntilDynamo
    cached = getattr(torch.optim.Optimizer.zero_grad.__wrapped__, "__dynamo_disable")
    assert not isinstance(cached, _UntilDynamo), "zero_grad still bypasses torch's disabled wrapper"
    compiled = torch.compile(lambda td: td["observation"].sum(), backend="eager")
    assert torch.isclose(compiled(batch), batch["observation"].sum())
    print("ok")
""")


def test_updates_do_not_import_dynamo_and_compiling_afterwards_sees_everything_marked():
    out = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def test_a_default_run_never_imports_dynamo(tmp_path):
    script = ("import runpy, sys\n"
              f"sys.argv = ['rltrain', 'trainer.total_frames=1024', 'hydra.run.dir={tmp_path}/run']\n"
              "try:\n    runpy.run_module('rltrain', run_name='__main__')\nexcept SystemExit as e:\n"
              "    assert not e.code, e.code\n"
              "print('dynamo' if 'torch._dynamo' in sys.modules else 'no dynamo')\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "no dynamo"
    assert (tmp_path / "run" / "summary.json").exists()


LIBRARY = textwrap.dedent("""
    import sys
    import rltrain
    from rltrain import build, Trainer  # noqa: F401  (the library's entry points, tensordict included)
    import torch.optim.optimizer as optimizer
    from rltrain import lazy_dynamo

    assert not lazy_dynamo.installed(), "import rltrain installed lazy_dynamo's import hook"
    for name in lazy_dynamo.OPTIMIZER_METHODS:
        cached = getattr(getattr(optimizer.Optimizer, name).__wrapped__, "__dynamo_disable", None)
        assert not isinstance(cached, lazy_dynamo._UntilDynamo), f"Optimizer.{name} bypasses torch's wrapper"
    assert optimizer._use_grad_for_differentiable.__module__ == "torch.optim.optimizer", "step's decorator replaced"
    import torch.compiler
    assert not any(isinstance(getattr(torch.compiler, n), lazy_dynamo._Marker) for n in lazy_dynamo.MARKERS)
    print("untouched")
""")


def test_import_rltrain_as_a_library_leaves_torch_untouched():
    out = subprocess.run([sys.executable, "-c", LIBRARY], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "untouched", out.stderr[-3000:]


def test_the_rltrain_command_installs_it_before_torch_is_imported():
    script = ("import sys\nimport rltrain.cli\nfrom rltrain import lazy_dynamo\n"
              "import torch.optim.optimizer as optimizer\n"
              "assert lazy_dynamo.installed()\n"
              "assert optimizer._use_grad_for_differentiable.__module__ == 'rltrain.lazy_dynamo'\n"
              "print('installed')\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "installed", out.stderr[-3000:]


def env_in_a_process_rltrain_owns(**kwargs) -> GymnasiumBatchedEnv:
    """A worker's env, made only where lazy_dynamo is installed (else the worker fails, naming why)."""
    assert lazy_dynamo.installed(), "this worker process runs without lazy_dynamo"
    return GymnasiumBatchedEnv("CartPole-v1", **kwargs)


def test_worker_processes_install_it():
    from rltrain.algos import ActorCritic
    from rltrain.collectors import LockstepCollector
    from rltrain.sync import SharedMemSync

    spec = GymnasiumBatchedEnv("CartPole-v1", num_envs=1).spec
    make_policy = functools.partial(ActorCritic, spec)
    scheme = SharedMemSync()
    sender = scheme.sender(make_policy())
    with LockstepCollector(env_in_a_process_rltrain_owns, make_policy, scheme.receiver, spec, frames_per_batch=8,
                           workers=1, envs_per_worker=2, timeout_s=60.0) as collector:
        assert next(iter(collector)).numel() == 8
    sender.close()
