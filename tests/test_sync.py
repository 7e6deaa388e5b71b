"""Weight sync (in-process shared memory): versioned snapshots, no leaks of live weights."""

from __future__ import annotations

import pytest
import torch

from rltrain.algos import ActorCritic
from rltrain.collectors import LocalCollector
from rltrain.envs import GymnasiumBatchedEnv
from rltrain.errors import SyncError
from rltrain.sync import NoSync, SharedMemSync


def make_pair(scheme, normalize_obs=True):
    env = GymnasiumBatchedEnv("CartPole-v1", num_envs=2, seed=0)
    learner = ActorCritic(env.spec, normalize_obs=normalize_obs)
    actor = ActorCritic(env.spec, normalize_obs=normalize_obs)  # different random init
    sender = scheme.sender(learner)
    collector = LocalCollector(lambda: env, lambda: actor, scheme.receiver, frames_per_batch=16)
    return learner, actor, sender, collector


def test_connect_gives_the_collector_the_learners_initial_weights():
    learner, actor, _, _ = make_pair(SharedMemSync())
    assert torch.equal(actor.actor[0].weight, learner.actor[0].weight)


def test_push_reaches_the_collector_at_the_next_batch_with_buffers_and_version():
    learner, actor, sender, collector = make_pair(SharedMemSync())
    batches = iter(collector)
    assert next(batches)["policy_version"].unique().tolist() == [0]
    with torch.no_grad():
        learner.actor[0].weight.fill_(0.5)
    learner.encoder.update(torch.randn(100, 4) * 3 + 7)
    assert sender.push() == 1
    batch = next(batches)
    assert batch["policy_version"].unique().tolist() == [1]
    assert torch.equal(actor.actor[0].weight, torch.full_like(actor.actor[0].weight, 0.5))
    norm, learner_norm = actor.encoder.parts["observation"].norm, learner.encoder.parts["observation"].norm
    assert torch.equal(norm.mean, learner_norm.mean)
    assert norm.count.item() == 100


def test_learner_changes_without_a_push_never_reach_the_collector():
    learner, actor, sender, collector = make_pair(SharedMemSync())
    batches = iter(collector)
    next(batches)
    before = actor.actor[0].weight.clone()
    with torch.no_grad():
        learner.actor[0].weight.add_(1.0)  # an optimizer step, in place, without a push
    next(batches)
    assert torch.equal(actor.actor[0].weight, before)
    assert actor.actor[0].weight.data_ptr() != learner.actor[0].weight.data_ptr()


def test_sync_none_keeps_the_collectors_own_weights():
    learner, actor, sender, collector = make_pair(NoSync())
    before = actor.actor[0].weight.clone()
    with torch.no_grad():
        learner.actor[0].weight.add_(1.0)
    assert sender.push() == 0
    batch = next(iter(collector))
    assert torch.equal(actor.actor[0].weight, before)
    assert batch["policy_version"].unique().tolist() == [0]


def test_a_snapshot_is_never_a_mix_of_two_versions():
    env = GymnasiumBatchedEnv("CartPole-v1", num_envs=1)
    learner, actor = ActorCritic(env.spec), ActorCritic(env.spec)
    scheme = SharedMemSync()
    sender = scheme.sender(learner)
    receiver = scheme.receiver()
    receiver.connect(actor)
    for version in range(1, 20):
        with torch.no_grad():
            for p in learner.parameters():
                p.fill_(version)
        sender.push()
        if version % 3 == 0:  # the receiver skips versions but always lands on a whole one
            assert receiver.poll()
            values = {p.unique().item() for p in actor.parameters()}
            assert values == {float(version)}, values
            assert receiver.version == version


def test_layout_mismatch_is_a_clear_error_at_connect():
    env = GymnasiumBatchedEnv("CartPole-v1", num_envs=1)
    scheme = SharedMemSync()
    scheme.sender(ActorCritic(env.spec, hidden_sizes=[64, 64]))
    with pytest.raises(SyncError, match=r"actor\.0\.weight: learner \(64, 4\) torch.float32, collector \(32, 4\)"):
        scheme.receiver().connect(ActorCritic(env.spec, hidden_sizes=[32, 64]))


def test_dtype_mismatch_is_a_clear_error_at_connect():
    env = GymnasiumBatchedEnv("CartPole-v1", num_envs=1)
    scheme = SharedMemSync()
    scheme.sender(ActorCritic(env.spec))
    with pytest.raises(SyncError, match="torch.float64"):
        scheme.receiver().connect(ActorCritic(env.spec).double())


def test_a_collector_acting_on_an_old_version_is_never_overwritten():
    env = GymnasiumBatchedEnv("CartPole-v1", num_envs=1)
    learner, slow, fast = ActorCritic(env.spec), ActorCritic(env.spec), ActorCritic(env.spec)
    scheme = SharedMemSync(slots=3)
    sender = scheme.sender(learner)
    slow_receiver, fast_receiver = scheme.receiver(), scheme.receiver()
    slow_receiver.connect(slow)
    fast_receiver.connect(fast)
    with torch.no_grad():
        for p in learner.parameters():
            p.fill_(1.0)
    sender.push()
    slow_receiver.poll()  # the slow collector acts with version 1 from now on
    for version in range(2, 8):
        with torch.no_grad():
            for p in learner.parameters():
                p.fill_(float(version))
        sender.push()
        fast_receiver.poll()
        assert {p.unique().item() for p in fast.parameters()} == {float(version)}
        assert {p.unique().item() for p in slow.parameters()} == {1.0}


def test_the_sync_lock_works_where_the_file_system_has_no_unnamed_files(monkeypatch, tmp_path):
    import os

    from rltrain.sync import shared_mem

    monkeypatch.setattr(shared_mem.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.delattr(shared_mem.os, "O_TMPFILE")  # as on overlayfs before Linux 6.6, or NFS
    lock = shared_mem._FileLock()
    assert lock.acquire(timeout=1.0)
    lock.release()
    assert os.listdir(tmp_path) == []  # a temporary file, unlinked at once: nothing to leave behind


def test_a_relay_pushes_the_weights_its_policy_is_bound_to_now():
    # A collector rank with workers relays received versions through shared_mem; receiving
    # rebinds its policy to new tensors, and each push must copy those, not the first ones.
    from rltrain.sync.base import bind_weights, named_weights

    learner, actor, sender, collector = make_pair(SharedMemSync())
    batches = iter(collector)
    next(batches)
    received = {name: torch.full_like(t, 0.25) for name, t in named_weights(learner).items()}
    bind_weights(learner, received)
    sender.push()
    next(batches)
    assert torch.equal(actor.actor[0].weight, torch.full_like(actor.actor[0].weight, 0.25))


@pytest.mark.parametrize("scheme", [SharedMemSync, NoSync])
def test_wait_for_applies_a_pushed_version_and_names_one_that_never_comes(scheme):
    """What a lock-step collector rank asks of its receiver before each batch (WeightReceiver.wait_for)."""
    learner, actor, sender, collector = make_pair(scheme())
    receiver = collector.receiver
    assert receiver.wait_for(0) == 0
    with torch.no_grad():
        learner.actor[0].weight.fill_(0.5)
    pushed = sender.push()
    assert receiver.wait_for(pushed) == pushed
    assert torch.equal(actor.actor[0].weight, learner.actor[0].weight) == scheme.PUSHES
    with pytest.raises(SyncError, match=f"weights version {pushed + 1} did not arrive within 0.1s"):
        receiver.wait_for(pushed + 1, timeout_s=0.1)
    receiver.wait_ended(0.1)  # nothing on its way: returns at once
    collector.close()
