"""A part's rules live beside its parameters (rltrain.rules); a user's own algo, collector or hook
declares them the same way and gets the same one-line error before anything starts."""

from __future__ import annotations

import pytest

from rltrain import build
from rltrain.errors import ConfigError
from rltrain.hooks.base import Schedule
from rltrain.rules import parameter_rules
from rltrain.sync import SharedMemSync
from tests.conftest import make_config, run_cli
from tests.parts_for_tests import KLPenaltyPPO, TaggingHook

ALGO = "algo._target_=tests.parts_for_tests.KLPenaltyPPO"
COLLECTOR = "collector._target_=tests.parts_for_tests.EveryOtherBatchCollector"
HOOK = "+hooks.tag._target_=tests.parts_for_tests.TaggingHook"

USER_PARTS = [
    ([ALGO, "+algo.kl_coef=-0.1"], "algo.kl_coef must be a number >= 0 (got -0.1)"),
    ([ALGO, "+algo.kl_decay=1.5"], "algo.kl_decay must be a number in [0, 1] (got 1.5)"),
    ([ALGO, "algo.lr=0"], "algo.lr must be a number > 0 (got 0)"),  # PPO's own rule, inherited
    ([ALGO, "+algo.kl_decay=0.9"], "algo.kl_decay=0.9 decays a penalty of 0; set algo.kl_coef > 0 too"),
    ([ALGO, "algo.minibatch_size=1024"], "algo.minibatch_size (1024) is larger than the batch"),  # PPO's combination
    ([COLLECTOR, "+collector.keep=0"], "collector.keep must be an integer >= 1 (got 0)"),
    ([COLLECTOR, "collector.frames_per_batch=100"], "must be a multiple of env.num_envs (16)"),  # its BATCH_ENVS
    ([HOOK, "+hooks.tag.level=loud"], "hooks.tag.level must be info or debug (got 'loud')"),
    ([HOOK, "+hooks.tag.every={frames: 0}"], "hooks.tag.every.frames must be an integer >= 1 (got 0)"),
    ([HOOK, "+hooks.tag.every={minutes: 5}"], "hooks.tag.every must be null or one of {frames|batches|updates|"),
]


@pytest.mark.parametrize(("overrides", "message"), USER_PARTS, ids=[" ".join(o[0][1:]) for o in USER_PARTS])
def test_a_users_own_part_gets_its_declared_rules_checked_before_anything_starts(overrides, message, tmp_path):
    with pytest.raises(ConfigError) as err:
        build(make_config(*overrides), run_dir=tmp_path / "run")
    assert message in str(err.value)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "run").exists(), "nothing may be written for a config that fails validation"


def test_a_users_own_parts_with_good_values_train(tmp_path):
    trainer = build(make_config(ALGO, "+algo.kl_coef=0.1", "+algo.kl_decay=0.9", COLLECTOR, "+collector.keep=2",
                                HOOK, "+hooks.tag.level=debug", "trainer.total_frames=1024"), run_dir=tmp_path)
    summary = trainer.fit()
    assert summary["status"] == "completed"
    assert trainer.algo.kl_decay == 0.9 and trainer.collector.keep == 2 and trainer.hooks["tag"].level == "debug"


def test_the_cli_refuses_a_users_bad_value_in_one_line(tmp_path):
    result = run_cli(HOOK, "+hooks.tag.level=loud", cwd=tmp_path)
    assert result.returncode == 2
    assert result.stderr.strip() == "rltrain: config error: hooks.tag.level must be info or debug (got 'loud')"


def test_a_class_reports_its_rules_and_its_bases():
    rules = parameter_rules(KLPenaltyPPO)
    assert rules["kl_decay"].allowed == "a number in [0, 1]"
    assert rules["gamma"].allowed == "a number in (0, 1]"  # PPO's
    assert parameter_rules(TaggingHook)["every"].allowed == "null or one of {frames|batches|updates|seconds: N}"


def test_a_constructor_called_from_python_asks_the_same_rule_as_the_config_check(tmp_path):
    with pytest.raises(ConfigError, match=r"every.seconds must be a number > 0 \(got 0\)"):
        Schedule({"seconds": 0})
    with pytest.raises(ConfigError, match=r"sync.slots must be an integer >= 2 \(one published, one being written\)"):
        SharedMemSync(slots=1)
    with pytest.raises(ConfigError, match="sync.slots must be an integer >= 2"):
        build(make_config("sync.slots=1"), run_dir=tmp_path / "run")


def test_a_runtime_object_set_in_the_config_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="hooks.log.run_dir is set by rltrain at build time; remove it"):
        build(make_config("+hooks.log.run_dir=here"), run_dir=tmp_path / "run")
