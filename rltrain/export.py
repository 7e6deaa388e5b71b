"""A trained policy as one standalone file that runs without rltrain: ONNX (onnxruntime) or TorchScript
(``torch.jit.load``), written from a run's newest checkpoint.

    python -m rltrain.export RUN_DIR --format onnx|torchscript [--out FILE] [--distribution]

The file maps observations to the policy's deterministic action: PPO's mode (a Box action's Gaussian mean, which
the env clips to its box), SAC's squashed mean in the env's scale, DQN's greedy action. With ``--distribution`` it
gives the distribution's parameters instead: PPO's logits (or a Box action's mean and log-std), SAC's pre-tanh mean
and log-std, DQN's Q-values. Observation normalization (``algo.network.normalize_obs``) is inside the file, with the
statistics of the checkpoint. Inputs, in order: the observation (a Dict observation: one input per key, in the
order of the env's space; an ``action_mask`` among them where the env gives one), then, for a recurrent policy,
``state`` (``[batch, state_size]``, zeros at an episode's start); outputs: the action (or the parameters), then for
a recurrent policy ``next_state``. Every input and output has a leading batch dimension of any size.
docs/export.md shows how to run the file with onnxruntime and numpy alone.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import os
import re
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from omegaconf import OmegaConf
from torch import nn

from rltrain import checkpoint
from rltrain.algos.heads import GaussianHead, mask_logits
from rltrain.algos.networks import ActorCritic, QNetwork, SquashedGaussianActor, run_layers
from rltrain.algos.recurrent import state_size
from rltrain.envs.spaces import MASK_KEY, EnvSpec, Leaf
from rltrain.errors import CheckpointError, ConfigError

FORMATS = {"onnx": ".onnx", "torchscript": ".pt"}
ONNX_OPSET = 17


class ExportError(ValueError):
    """A policy that cannot be written in the format asked for."""


class PolicyGraph(nn.Module):
    """``policy`` as a function of plain tensors: ``forward(*observation_leaves[, state])`` -> action (or the
    distribution's parameters) [, next state]; what the exported file computes."""

    def __init__(self, policy: nn.Module, spec: EnvSpec, distribution: bool = False):
        super().__init__()
        if not isinstance(policy, (ActorCritic, SquashedGaussianActor, QNetwork)):
            raise ExportError(f"rltrain.export writes rltrain's policies (ActorCritic, SquashedGaussianActor, "
                              f"QNetwork), not {type(policy).__name__}: export your own module with torch.onnx.export")
        self.policy, self.distribution = policy, distribution
        self.keys = None if isinstance(spec.observation, Leaf) else list(spec.observation)
        self.recurrent = state_size(policy) > 0

    def forward(self, *inputs: torch.Tensor):
        obs = inputs[0] if self.keys is None else dict(zip(self.keys, inputs))
        policy = self.policy
        if not self.distribution:  # the policy's own deterministic act
            if self.recurrent:
                action, _, state = policy.act_in_state(obs, inputs[-1], deterministic=True)
                return action, state
            return policy.act(obs, deterministic=True)[0]
        if isinstance(policy, QNetwork):
            return policy(obs)
        if isinstance(policy, SquashedGaussianActor):
            return policy.mean_log_std(obs)
        features = policy.encoder(obs)
        state = None
        if self.recurrent:
            features, state = policy.core.step(features, inputs[-1])
        logits = run_layers(policy.actor, features)
        if policy.masked:
            logits = mask_logits(logits, obs[MASK_KEY])
        out = (logits, policy.head.log_std.expand_as(logits)) if isinstance(policy.head, GaussianHead) else (logits,)
        return (*out, state) if self.recurrent else (out if len(out) > 1 else out[0])

    def names(self) -> tuple[list[str], list[str]]:
        """The file's input and output names."""
        inputs = ["observation"] if self.keys is None else list(self.keys)
        if self.recurrent:
            inputs.append("state")
        policy = self.policy
        if not self.distribution:
            outputs = ["action"]
        elif isinstance(policy, QNetwork):
            outputs = ["q_values"]
        elif isinstance(policy, SquashedGaussianActor) or isinstance(policy.head, GaussianHead):
            outputs = ["mean", "log_std"]
        else:
            outputs = ["logits"]
        return inputs, outputs + (["next_state"] if self.recurrent else [])


def example_inputs(spec: EnvSpec, policy: nn.Module, batch: int = 2) -> tuple[torch.Tensor, ...]:
    """Zeros shaped and typed as the file's inputs (an observation's leaves, then the state), ``batch`` rows."""
    leaves = [spec.observation] if isinstance(spec.observation, Leaf) else list(spec.observation.values())
    inputs = [torch.zeros(batch, *leaf.shape, dtype=getattr(torch, leaf.dtype)) for leaf in leaves]
    if state_size(policy):
        inputs.append(policy.initial_state(batch))
    return tuple(inputs)


def load_policy(run_dir: Path) -> tuple[nn.Module, EnvSpec, Path]:
    """The policy of ``run_dir``'s newest checkpoint, built from the config the checkpoint holds; its env's spec;
    the checkpoint's path."""
    from rltrain.factory import _env_and_policy  # (the factory imports Hydra's machinery: only when exporting)
    from rltrain.wiring import is_language_task

    saved = checkpoint.listing(run_dir)
    if not saved:
        raise CheckpointError(f"{run_dir} holds no checkpoint ({checkpoint.DIRNAME}/frames_*.pt): export reads a "
                              "run's newest one; train with the checkpoint hook (it saves at the end by default)")
    if saved[-1].is_dir():
        raise CheckpointError(f"{saved[-1]} is a sharded checkpoint: export reads one-file checkpoints")
    state = checkpoint.load(saved[-1])
    cfg = OmegaConf.create(state[checkpoint.CONFIG_KEY])  # the run's own config, resolved when it was saved
    if is_language_task(cfg):
        raise ConfigError(f"{run_dir} trained a language model: its weights are a Hugging Face model already "
                          "(hooks.save_pretrained writes model/ in the run dir); rltrain.export writes env policies")
    _, spec, make_policy = _env_and_policy(cfg)
    policy = make_policy()
    policy.load_state_dict(state["algo"]["policy"])
    return policy.eval(), spec, saved[-1]


def export(run_dir: str | Path, format: str = "onnx", out: str | Path | None = None,
           distribution: bool = False) -> Path:
    """Write ``run_dir``'s policy as one ``format`` file (default: ``RUN_DIR/policy.onnx`` or ``policy.pt``)."""
    if format not in FORMATS:
        raise ConfigError(f"--format {format!r}: choose onnx or torchscript")
    run_dir = Path(run_dir)
    policy, spec, _ = load_policy(run_dir)
    graph = PolicyGraph(policy, spec, distribution).eval()
    inputs = example_inputs(spec, policy)
    out = Path(out) if out is not None else run_dir / f"policy{FORMATS[format]}"
    out.parent.mkdir(parents=True, exist_ok=True)
    input_names, output_names = graph.names()
    try:
        with torch.no_grad(), warnings.catch_warnings(), _stdout_of_this_process() as printed:
            warnings.simplefilter("ignore")  # the TorchScript-based exporter's deprecation notice
            if format == "onnx":
                torch.onnx.export(graph, inputs, str(out), dynamo=False, opset_version=ONNX_OPSET,
                                  input_names=input_names, output_names=output_names,
                                  dynamic_axes={name: {0: "batch"} for name in input_names + output_names})
            else:
                torch.jit.save(torch.jit.trace(graph, inputs), str(out))
    except Exception as e:  # noqa: BLE001  (the exporter's own error, named with the part and the way out)
        other = "torchscript" if format == "onnx" else "onnx"
        raise ExportError(f"{format} cannot express {_part(e, ''.join(printed), policy)}; try --format "
                          f"{other}") from e
    return out


def _defines(function, file: str, line: int) -> bool:
    """Whether ``function``'s source is ``file`` and spans ``line``."""
    try:
        lines, first = inspect.getsourcelines(function)
        return Path(inspect.getsourcefile(function)).resolve() == Path(file).resolve() and \
            first <= line < first + len(lines)
    except (OSError, TypeError):
        return False


@contextlib.contextmanager
def _stdout_of_this_process():
    """What this process (C++ included) writes to its stdout meanwhile, kept (a list that gets the text when the
    block ends) and not shown: the ONNX exporter prints there the graph it failed on, which ``_part`` reads."""
    text: list[str] = []
    with tempfile.TemporaryFile(mode="w+") as file:
        sys.stdout.flush()
        saved = os.dup(1)
        os.dup2(file.fileno(), 1)
        try:
            yield text
        finally:
            sys.stdout.flush()
            os.dup2(saved, 1)
            os.close(saved)
            file.seek(0)
            text.append(file.read())


def _part(error: Exception, printed: str, policy: nn.Module) -> str:
    """What the exporter failed on: the operator and the policy's module that holds it (from the graph it printed:
    each node's ``scope`` is its module path), or the exporter's first line."""
    message = (str(error).strip().splitlines() or [type(error).__name__])[0]
    op = re.search(r"operator '([\w:.]+)'", message)
    if op is None:
        return f"{type(policy).__name__} ({message})"
    for line in printed.splitlines():  # the op's node: "... = aten::cummax(%x, %1), scope: ... # FILE:LINE:COL"
        if f"= {op.group(1)}(" in line and (source := re.search(r"# (.+):(\d+):\d+$", line)):
            for path, module in policy.named_modules():
                if _defines(type(module).forward, source.group(1), int(source.group(2))):
                    return (f"the operator {op.group(1)} in {type(policy).__name__}'s {type(module).__name__} at "
                            f"algo.network's {path or 'top'} ({message})")
    return f"the operator {op.group(1)} in {type(policy).__name__} ({message})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m rltrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", help="a run dir (its newest checkpoint is exported)")
    parser.add_argument("--format", default="onnx", choices=list(FORMATS))
    parser.add_argument("--out", default=None, help="the file to write (default: RUN_DIR/policy.onnx or policy.pt)")
    parser.add_argument("--distribution", action="store_true",
                        help="output the action distribution's parameters instead of the deterministic action")
    args = parser.parse_args(argv)
    try:
        out = export(args.run_dir, args.format, args.out, args.distribution)
    except (CheckpointError, ConfigError, ExportError) as e:
        print(f"rltrain.export: {e}", file=sys.stderr)
        return 2
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
