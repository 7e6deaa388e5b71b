"""Every config choice composes and builds; bad input fails early with a message naming the key."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from rltrain import build
from rltrain.errors import ConfigError
from tests.conftest import CONFIGS, ROOT, make_config, run_cli

DATA = ROOT / "tests" / "data"

GROUPS = ["algo", "env", "collector", "sync", "logger", "hooks", "model", "engine"]
# The language-model options (a task, its collector, hooks and model) go with algo=grpo.
LANGUAGE = ["algo=grpo"]


def all_choices():
    return [(group, path.stem) for group in GROUPS for path in sorted((CONFIGS / group).glob("*.yaml"))]


@pytest.mark.parametrize(("group", "choice"), all_choices())
def test_every_group_choice_composes_and_builds(group, choice, tmp_path):
    # sync=pipe|distributed need worker processes, SAC continuous actions (build rejects the defaults' pairing).
    # Atari: an untrained argmax policy never presses FIRE, so an evaluation would play out whole
    # time-limited games (over 200 s); a few hundred steps show the eval path works.
    extra = {("sync", "pipe"): ["collector=lockstep"], ("sync", "distributed"): ["collector=lockstep"],
             ("algo", "sac"): ["env=pendulum"], ("env", "atari"): ["+hooks.eval.max_steps=300"],
             ("env", "atari_loop"): ["+hooks.eval.max_steps=300"], ("env", "arithmetic"): LANGUAGE,
             ("env", "reverse"): LANGUAGE, ("env", "tools"): LANGUAGE, ("env", "guess"): LANGUAGE,
             ("collector", "generation"): LANGUAGE, ("hooks", "llm"): LANGUAGE,
             ("model", "tiny"): LANGUAGE, ("sync", "vllm"): [*LANGUAGE, "engine=vllm"],
             ("sync", "vllm_transfer"): [*LANGUAGE, "engine=vllm"], ("engine", "transformers"): LANGUAGE,
             ("engine", "vllm"): LANGUAGE, ("engine", "learner"): LANGUAGE,
             ("sync", "in_place"): [*LANGUAGE, "engine=learner"], ("engine", "vllm_server"): [*LANGUAGE, "engine.url=http://127.0.0.1:9"],
             ("env", "dataset"): [*LANGUAGE, f"env.path={DATA / 'sums.jsonl'}", "env.prompt_key=question"],
             }.get((group, choice), [])
    cfg = make_config(f"{group}={choice}", "trainer.total_frames=512", *extra)
    if (group, choice) == ("collector", "distributed"):  # its collectors are other ranks: tests/test_distributed.py
        with pytest.raises(ConfigError, match="launch with torchrun --nproc-per-node=3"):
            build(cfg, run_dir=tmp_path)
        return
    if (group, choice) == ("engine", "vllm_server"):  # a server of the user's: tests/test_vllm_server.py
        with pytest.raises(ConfigError, match=r"engine.url=http://127.0.0.1:9: no vLLM server answers there"):
            build(cfg, run_dir=tmp_path)
        return
    trainer = build(cfg, run_dir=tmp_path)
    summary = trainer.fit()
    assert summary["status"] == "completed"
    assert summary["frames"] >= 256


BAD_INPUT = [
    (["algo.lr=-1"], "algo.lr must be a number > 0 (got -1)"),
    (["collector.frames_per_batch=0"], "collector.frames_per_batch must be an integer >= 1 (got 0)"),
    (["sync.every=0"], "sync.every must be an integer >= 1, or null (never push) (got 0)"),
    (["algo.minibatch_size=1024"], "algo.minibatch_size (1024) is larger than the batch"),
    (["env.id=NoSuchEnv-v0"], "env.id='NoSuchEnv-v0' is not a registered gymnasium environment"),
    (["env.id=no_such_module:Foo-v0"], "could not import module 'no_such_module'"),
    (["+algo.lrr=0.1"], "algo.lrr is not a parameter of rltrain.algos.PPO"),
    (["collector.frames_per_batch=100"], "must be a multiple of env.num_envs (16)"),
    (["env.num_envs=0"], "env.num_envs must be an integer >= 1 (got 0)"),
    (["algo.gamma=1.5"], "algo.gamma must be a number in (0, 1] (got 1.5)"),
    # Non-finite numbers where a finite one is needed: refused up front, not at the first update.
    (["algo.lr=inf"], "algo.lr must be a number > 0 (got inf)"),
    (["algo.ent_coef=nan"], "algo.ent_coef must be a number >= 0 (got nan)"),
    (["trainer.stop_at_return=nan"], "trainer.stop_at_return must be a number, auto"),
    (["hooks.log.every.seconds=inf"], "hooks.log.every.seconds must be a number > 0"),
    (["trainer.total_frames=0"], "trainer.total_frames must be an integer >= 1"),
    (["hooks.log.every.seconds=0"], "hooks.log.every.seconds must be a number > 0"),
    (["algo.network.activation=sigmoid"], "algo.network.activation must be one of"),
    (["+hooks.mine._target_=no_such_pkg.Hook"], "hooks.mine._target_='no_such_pkg.Hook' cannot be imported"),
    (["device=tpu"], "device must be cpu, cuda, cuda:N or auto"),
    (["env.id=ALE/NoSuchGame-v5"], "env.id='ALE/NoSuchGame-v5'"),
    # Keys nothing reads, anywhere in rltrain's own sections, with the closest valid one.
    (["+foo=1"], "foo is not a top-level key of rltrain's config (valid: seed, device, threads, resume, objective, "
                 "trainer,"),
    (["+sed=1"], "sed is not a top-level key of rltrain's config; did you mean seed?"),
    (["+trainer.total_frame=100"], "trainer.total_frame is not a key of trainer (the arguments of rltrain.Trainer); "
                                   "did you mean trainer.total_frames?"),
    (["+algo.lrr=0.1"], "did you mean algo.lr?"),
    (["+env.num_env=3"], "env.num_env is not a parameter of rltrain.envs.make_envs; did you mean env.num_envs?"),
    (["algo._target_=tests.policies_for_tests.UpdateOnlyAlgo"],
     "algo._target_=tests.policies_for_tests.UpdateOnlyAlgo lacks state_dict, load_state_dict of rltrain's Algo "
     "interface; add them (see rltrain.protocols.Algo"),
    (["trainer.total_frames=1e9"], "trainer.total_frames must be an integer >= 1 (got 1000000000.0); write 1000000000"),
    (["algo=sac", "env=pendulum", "algo.buffer_size=10"],
     "algo.buffer_size (10) is smaller than algo.batch_size (256): the replay buffer cannot hold"),
    (["algo=sac", "env=pendulum", "algo.buffer_size=300"],
     "algo.buffer_size (300) is smaller than collector.frames_per_batch (512)"),
]


@pytest.mark.parametrize(("overrides", "message"), BAD_INPUT, ids=[" ".join(o[0]) for o in BAD_INPUT])
def test_build_rejects_bad_input_with_the_key_in_the_message(overrides, message, tmp_path):
    cfg = make_config(*overrides)
    with pytest.raises(ConfigError) as err:
        build(cfg, run_dir=tmp_path / "run")
    assert message in str(err.value)
    assert not (tmp_path / "run").exists(), "nothing may be written for a config that fails validation"


def test_cli_bad_value_exits_fast_with_one_paragraph_and_no_traceback(tmp_path):
    start = time.monotonic()
    result = run_cli("algo.lr=-1", "logger=[console,wandb]", cwd=tmp_path)
    assert result.returncode == 2
    assert time.monotonic() - start < 30
    assert "rltrain: config error: algo.lr must be a number > 0 (got -1)" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    assert not list(tmp_path.rglob("wandb")), "no wandb run may be created for bad input"
    assert not (tmp_path / "outputs").exists(), "the run dir Hydra made is removed again"


def test_a_sweep_checks_every_jobs_config_before_the_first_job_starts(tmp_path):
    result = run_cli("-m", "algo.gamma=0.9,1.5", "trainer.total_frames=1024", cwd=tmp_path)
    assert result.returncode == 2
    assert ("rltrain: config error in sweep job 1 (algo.gamma=1.5 trainer.total_frames=1024): algo.gamma must be "
            "a number in (0, 1] (got 1.5). No job was started") in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "outputs").exists(), "job 0 must not have run"


def test_a_checked_sweep_resolves_hydra_interpolations_as_its_jobs_will(tmp_path):
    result = run_cli("-m", "seed=${hydra:job.num}", "algo.lr=1e-3,3e-3", "trainer.total_frames=512", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert len(list((tmp_path / "outputs" / "multirun").glob("*/*/*/summary.json"))) == 2


def test_resume_auto_warns_about_an_unreadable_config_file(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    broken = tmp_path / "outputs" / "2026-01-01" / "00-00-00" / "checkpoints" / "config.json"
    broken.parent.mkdir(parents=True)
    broken.write_text("{not json")
    caplog.set_level("INFO", logger="rltrain")
    trainer = build(make_config("resume=auto", "trainer.total_frames=512"))
    trainer.fit()
    assert f"resume=auto: skipping {broken}, which cannot be read (JSONDecodeError" in caplog.text
    assert trainer.state.run_dir != broken.parent.parent and trainer.state.frames == 512


def test_the_old_name_of_the_lock_step_collector_says_the_new_one(tmp_path):
    result = run_cli("collector=sync", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == ("rltrain: collector=sync is now collector=lockstep (lock-step worker processes; "
                                     "sync= chooses how weights travel)")


def test_cli_unknown_group_choice_lists_the_available_ones(tmp_path):
    result = run_cli("algo=a2c", cwd=tmp_path)
    assert result.returncode != 0
    assert "Could not find 'algo/a2c'" in result.stderr
    assert "ppo" in result.stderr
    assert "Traceback" not in result.stderr


def test_cli_unknown_key_is_rejected_by_struct_mode(tmp_path):
    result = run_cli("algo.lrr=1", cwd=tmp_path)
    assert result.returncode != 0
    assert "algo.lrr" in result.stderr
    assert "Traceback" not in result.stderr


def test_full_error_env_var_shows_the_traceback(tmp_path):
    result = run_cli("algo.lr=-1", cwd=tmp_path, env={"HYDRA_FULL_ERROR": "1"})
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "ConfigError" in result.stderr


def test_help_lists_the_config_groups(tmp_path):
    result = run_cli("--help", cwd=tmp_path)
    assert result.returncode == 0
    for line in ["algo: dqn, grpo, ppo, sac", "collector: async, distributed, generation, local, lockstep",
                 "model: tiny",
                 "sync: distributed, in_place, none, pipe, shared_mem",
                 "logger: console, csv, tensorboard, wandb"]:
        assert line in result.stdout
    assert "env: " in result.stdout and "cartpole" in result.stdout
    assert result.stdout.startswith("rltrain: declarative") and "Error" not in result.stdout + result.stderr


def test_cfg_job_prints_the_composed_config_with_overrides(tmp_path):
    result = run_cli("--cfg", "job", "env=pendulum", "algo.lr=0.002", cwd=tmp_path)
    assert result.returncode == 0
    assert "id: Pendulum-v1" in result.stdout
    assert "lr: 0.002" in result.stdout
    assert not (tmp_path / "outputs").exists()


def test_configs_open_with_a_comment_saying_what_they_are_for():
    for path in sorted(Path(CONFIGS).rglob("*.yaml")):
        assert path.read_text().startswith("#"), f"{path} should open with a comment"
