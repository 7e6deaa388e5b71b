"""GRPO's arithmetic against a step-by-step reference: group advantages, the clipped token surrogate,
the KL penalty, truncated importance sampling and the three aggregations; micro-batches add up to the
batch; padding never counts."""

from __future__ import annotations

import math
import statistics

import pytest
import torch

from rltrain.algos.grpo_loss import (
    AGGREGATIONS,
    Normalizer,
    aggregate,
    group_advantages,
    kl_k3,
    tis_diagnostics,
    tis_weights,
    token_losses,
)

CLIP_LOW, CLIP_HIGH, KL_COEF, MAX_TOKENS, TIS_CAP = 0.2, 0.28, 0.05, 9, 2.0


def test_group_advantages_match_a_loop_over_groups():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 2.0, -1.0, 0.0, 3.0])
    adv, flat = group_advantages(rewards, group_size=4)
    expected = []
    for g in range(3):
        group = rewards[4 * g: 4 * g + 4].tolist()
        mean, std = statistics.mean(group), statistics.stdev(group)
        expected += [0.0 if std == 0 else (r - mean) / (std + 1e-4) for r in group]
    assert torch.allclose(adv, torch.tensor(expected), atol=1e-6) and flat == 1
    centred, _ = group_advantages(rewards, group_size=4, scale=False)
    assert torch.allclose(centred[:4], torch.tensor([0.5, -0.5, -0.5, 0.5]))


def batch(seed: int = 0, sequences: int = 6, width: int = 9):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 1, 4, 7, 2, 9])[:sequences]
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    old = -torch.rand(sequences, width, generator=g) * 3
    new = old + torch.randn(sequences, width, generator=g) * 0.4  # ratios on both sides of the clip range
    ref = old + torch.randn(sequences, width, generator=g) * 0.2
    adv = torch.randn(sequences, generator=g)
    return new, old, ref, adv, mask


def sampler_logprobs(old, seed: int = 0):
    """What another engine (or weights a version behind) gave the same tokens: some ratios over TIS_CAP."""
    return old - torch.randn(old.shape, generator=torch.Generator().manual_seed(seed)) * 0.6


def reference_loss(new, old, ref, adv, mask, how, sampling=None):
    """One token at a time, as the papers write it (Yao et al. 2025's truncated weight when ``sampling``)."""
    per_sequence, total, tokens = [], 0.0, 0
    for i in range(new.shape[0]):
        seq = []
        for t in range(new.shape[1]):
            if not mask[i, t]:
                continue
            ratio = math.exp(new[i, t] - old[i, t])
            clipped = min(max(ratio, 1 - CLIP_LOW), 1 + CLIP_HIGH)
            surrogate = min(ratio * adv[i], clipped * adv[i])
            if sampling is not None:
                surrogate *= min(math.exp(old[i, t] - sampling[i, t]), TIS_CAP)
            d = float(ref[i, t] - new[i, t])
            seq.append(-surrogate + KL_COEF * (math.exp(d) - d - 1))
        per_sequence.append(sum(seq) / max(1, len(seq)))
        total += sum(seq)
        tokens += len(seq)
    return {"token_mean": total / tokens, "sequence_mean": sum(per_sequence) / len(per_sequence),
            "constant": total / (new.shape[0] * MAX_TOKENS)}[how]


@pytest.mark.parametrize("how", AGGREGATIONS)
def test_the_loss_matches_the_reference_for_each_aggregation(how):
    new, old, ref, adv, mask = batch()
    losses = token_losses(new, old, adv, CLIP_LOW, CLIP_HIGH, ref, KL_COEF)
    loss = aggregate(losses, mask, how, Normalizer.of(mask, MAX_TOKENS))
    assert math.isclose(loss.item(), reference_loss(new, old, ref, adv, mask, how), rel_tol=1e-5)


@pytest.mark.parametrize("how", AGGREGATIONS)
def test_micro_batches_add_up_to_the_whole_batch_and_its_gradient(how):
    new, old, ref, adv, mask = batch(seed=1)
    norm = Normalizer.of(mask, MAX_TOKENS)
    whole = new.clone().requires_grad_()
    aggregate(token_losses(whole, old, adv, CLIP_LOW, CLIP_HIGH, ref, KL_COEF), mask, how, norm).backward()
    parts, total = new.clone().requires_grad_(), 0.0
    for rows in (slice(0, 2), slice(2, 3), slice(3, 6)):  # uneven micro-batches, accumulated
        loss = aggregate(token_losses(parts[rows], old[rows], adv[rows], CLIP_LOW, CLIP_HIGH, ref[rows], KL_COEF),
                         mask[rows], how, norm)
        loss.backward()
        total += loss.item()
    expected = aggregate(token_losses(new, old, adv, CLIP_LOW, CLIP_HIGH, ref, KL_COEF), mask, how, norm)
    assert math.isclose(total, expected.item(), rel_tol=1e-5)
    assert torch.allclose(parts.grad, whole.grad, atol=1e-7)


@pytest.mark.parametrize("how", AGGREGATIONS)
def test_padding_never_changes_the_loss(how):
    new, old, ref, adv, mask = batch(seed=2)
    loss = aggregate(token_losses(new, old, adv, CLIP_LOW, CLIP_HIGH, ref, KL_COEF), mask, how,
                     Normalizer.of(mask, MAX_TOKENS))
    pad = 5  # five more positions of garbage, masked out
    wide = [torch.cat([x, torch.full((x.shape[0], pad), value)], dim=1)
            for x, value in ((new, 7.0), (old, -9.0), (ref, 3.0), (mask, 0.0))]
    padded = aggregate(token_losses(wide[0], wide[1], adv, CLIP_LOW, CLIP_HIGH, wide[2], KL_COEF), wide[3], how,
                       Normalizer.of(wide[3], MAX_TOKENS))
    assert math.isclose(loss.item(), padded.item(), rel_tol=1e-6)


def test_the_clip_is_asymmetric_and_k3_is_never_negative():
    adv = torch.tensor([1.0, -1.0])
    old = torch.zeros(2, 1)
    high = token_losses(torch.full((2, 1), math.log(2.0)), old, adv, 0.2, 0.28)  # ratio 2
    assert torch.allclose(high[:, 0], torch.tensor([-1.28, 2.0]))  # gains stop at 1 + clip_high; losses are not clipped
    low = token_losses(torch.full((2, 1), math.log(0.5)), old, adv, 0.2, 0.28)  # ratio 0.5
    assert torch.allclose(low[:, 0], torch.tensor([-0.5, 0.8]))
    assert (kl_k3(torch.randn(100), torch.randn(100)) >= 0).all()
    assert kl_k3(torch.ones(3), torch.ones(3)).abs().max() == 0


@pytest.mark.parametrize("how", AGGREGATIONS)
def test_the_tis_weighted_loss_matches_the_reference_for_each_aggregation(how):
    new, old, ref, adv, mask = batch(seed=3)
    sampling = sampler_logprobs(old)
    ratio = torch.exp(old - sampling)[mask.bool()]
    assert (ratio > TIS_CAP).any() and (ratio < 1).any()  # some weights truncated, some below 1
    losses = token_losses(new, old, adv, CLIP_LOW, CLIP_HIGH, ref, KL_COEF, tis_weights(old, sampling, TIS_CAP))
    loss = aggregate(losses, mask, how, Normalizer.of(mask, MAX_TOKENS))
    assert math.isclose(loss.item(), reference_loss(new, old, ref, adv, mask, how, sampling), rel_tol=1e-5)
    unweighted = aggregate(token_losses(new, old, adv, CLIP_LOW, CLIP_HIGH, ref, KL_COEF), mask, how,
                           Normalizer.of(mask, MAX_TOKENS))
    assert math.isclose(unweighted.item(), reference_loss(new, old, ref, adv, mask, how), rel_tol=1e-5)
    assert not math.isclose(loss.item(), unweighted.item(), rel_tol=1e-2)


def test_the_weights_are_truncated_at_the_cap_and_carry_no_gradient():
    old = torch.zeros(1, 4, requires_grad=True)
    sampling = torch.log(torch.tensor([[2.0, 1.0, 0.5, 0.1]]))  # ratios 0.5, 1, 2 and 10
    weights = tis_weights(old, sampling, cap=3.0)
    assert torch.allclose(weights, torch.tensor([[0.5, 1.0, 2.0, 3.0]])) and not weights.requires_grad


def test_the_weight_scales_the_surrogate_and_not_the_kl_penalty():
    new, old, ref, adv, mask = batch(seed=4)
    plain = token_losses(new, old, adv, CLIP_LOW, CLIP_HIGH, ref, KL_COEF)
    kl = KL_COEF * kl_k3(new, ref)
    doubled = token_losses(new, old, adv, CLIP_LOW, CLIP_HIGH, ref, KL_COEF, torch.full_like(new, 2.0))
    assert torch.allclose(doubled, 2 * (plain - kl) + kl)
    zero = token_losses(new, old, adv, CLIP_LOW, CLIP_HIGH, ref, KL_COEF, torch.zeros_like(new))
    assert torch.allclose(zero, kl)


def test_the_diagnostics_match_a_hand_computation():
    old = torch.zeros(2, 3)
    sampling = torch.log(torch.tensor([[2.0, 1.0, 0.25], [0.5, 1.0, 1e-9]]))  # ratios 0.5 1 4 / 2 1 (padding)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    got = tis_diagnostics(old, sampling, mask, cap=3.0)
    weights = [0.5, 1.0, 3.0, 2.0, 1.0]  # 4 truncated to 3; the padded 1e9 never counts
    ess = sum(weights) ** 2 / (len(weights) * sum(w * w for w in weights))
    assert got == pytest.approx({"ratio_mean": (0.5 + 1 + 4 + 2 + 1) / 5, "ratio_max": 4.0, "ess": ess,
                                 "truncated": 1 / 5})
    same = tis_diagnostics(old, torch.full((2, 3), -2.0), mask, cap=3.0)  # every ratio e^2 = 7.4, every weight 3
    assert same == pytest.approx({"ratio_mean": math.exp(2), "ratio_max": math.exp(2), "ess": 1.0, "truncated": 1.0})
    nothing = tis_diagnostics(old, sampling, torch.zeros(2, 3), cap=3.0)
    assert nothing == {"ratio_mean": 0.0, "ratio_max": 0.0, "ess": 0.0, "truncated": 0.0}
