"""GRPO-family policy losses and rollout scoring against plain-numpy references written from the
papers' formulas: values, metrics, gradients, masking and errors."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from axplug_rl.advantages import group_advantages, overlong_penalty, pass_at_k, varied_groups
from axplug_rl.loss import DEFAULT_CLIP, LOSSES, policy_loss

B, T = 6, 8
MAX_TOKENS = 10
KL_BETA, TIS_CAP = 0.04, 2.0
# Rows of different lengths, one with no tokens (row 2), one with gaps (row 4).
MASK = np.array(
    [
        [1, 1, 1, 1, 1, 1, 1, 1],
        [0, 0, 1, 1, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0, 0, 0],
        [1, 1, 1, 0, 0, 0, 0, 0],
        [1, 0, 1, 0, 1, 0, 1, 0],
        [1, 0, 0, 0, 0, 0, 0, 0],
    ],
    bool,
)


def _data(seed: int = 0) -> dict[str, np.ndarray]:
    """float32 rollout tensors: the policy moved away from the sampler, a reference and a
    sampler that is not bit-equal to the trainer, both nearby."""
    rng = np.random.default_rng(seed)
    old = rng.uniform(-4.0, -0.5, (B, T))
    return {
        "logps": (old + rng.normal(0.0, 0.3, (B, T))).astype(np.float32),
        "old_logps": old.astype(np.float32),
        "advantages": rng.normal(0.0, 1.0, B).astype(np.float32),
        "ref_logps": (old + rng.normal(0.0, 0.3, (B, T))).astype(np.float32),
        "behavior_logps": (old + rng.normal(0.0, 0.6, (B, T))).astype(np.float32),
    }


DATA = _data()


def _reference(
    logps,
    old,
    adv,
    mask,
    kind,
    *,
    clip=None,
    ref=None,
    beta=0.0,
    cap=None,
    behavior=None,
    max_tokens=None,
):
    """(loss, metrics) in float64 loops, straight from the papers' formulas."""
    lo, hi = clip or DEFAULT_CLIP[kind]
    logps, old, adv = (np.asarray(x, np.float64) for x in (logps, old, adv))

    def surrogate(r, a):
        return -min(r * a, min(max(r, 1 - lo), 1 + hi) * a)

    def clipped(r, a):  # min() picks the clipped branch and it differs
        return min(max(r, 1 - lo), 1 + hi) * a < r * a

    def k3(i, t):
        d = float(ref[i, t]) - logps[i, t]
        return math.exp(d) - d - 1

    ratios, clips, kls, weights, row_losses = [], [], [], [], []
    for i in range(B):
        tokens = [t for t in range(T) if mask[i, t]]
        if kind == "gspo":
            if not tokens:
                row_losses.append([])
                continue
            s = math.exp(sum(logps[i, t] - old[i, t] for t in tokens) / len(tokens))
            term = surrogate(s, adv[i])
            if cap is not None:
                log_w = sum(old[i, t] - float(behavior[i, t]) for t in tokens) / len(tokens)
                w = min(math.exp(log_w), cap)
                term *= w
                weights.append(w)
            if beta:
                row_kl = [k3(i, t) for t in tokens]
                term += beta * sum(row_kl) / len(row_kl)
                kls += row_kl
            row_losses.append([term])
            ratios.append(s)
            clips.append(clipped(s, adv[i]))
            continue
        row = []
        for t in tokens:
            r = math.exp(logps[i, t] - old[i, t])
            term = surrogate(r, adv[i])
            if cap is not None:
                w = min(math.exp(old[i, t] - float(behavior[i, t])), cap)
                term *= w
                weights.append(w)
            if beta:
                kls.append(k3(i, t))
                term += beta * kls[-1]
            row.append(term)
            ratios.append(r)
            clips.append(clipped(r, adv[i]))
        row_losses.append(row)

    if kind == "grpo":
        loss = sum(sum(row) / len(row) for row in row_losses if row) / B
    elif kind == "dr_grpo":
        loss = sum(sum(row) for row in row_losses) / (B * max_tokens)
    elif kind == "dapo":
        loss = sum(sum(row) for row in row_losses) / sum(len(row) for row in row_losses)
    else:
        loss = sum(sum(row) for row in row_losses) / B
    metrics = {
        "clip_fraction": np.mean(clips),
        "ratio_mean": np.mean(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "kl": np.mean(kls) if kls else 0.0,
    }
    if cap is not None:
        metrics["tis_mean"] = np.mean(weights)
    return loss, metrics


def _options(kind, kl, tis, data=DATA):
    """policy_loss's keyword arguments and the reference's, for one configuration."""
    ours = {"kind": kind, "max_tokens": MAX_TOKENS if kind == "dr_grpo" else None}
    theirs = {"kind": kind, "max_tokens": MAX_TOKENS}
    if kl:
        ours |= {"ref_logps": data["ref_logps"], "kl_beta": KL_BETA}
        theirs |= {"ref": data["ref_logps"], "beta": KL_BETA}
    if tis:
        ours |= {"tis_cap": TIS_CAP, "behavior_logps": data["behavior_logps"]}
        theirs |= {"cap": TIS_CAP, "behavior": data["behavior_logps"]}
    return ours, theirs


def _args(data=DATA, mask=MASK):
    return data["logps"], data["old_logps"], data["advantages"], mask


def test_the_data_exercise_clipping_signs_and_truncation():
    ratio = np.exp(DATA["logps"] - DATA["old_logps"].astype(np.float64))[MASK]
    assert (ratio > 1.28).any() and (ratio < 0.8).any() and ((ratio > 0.8) & (ratio < 1.2)).any()
    adv = DATA["advantages"][MASK.any(1)]
    assert (adv > 0).any() and (adv < 0).any()
    weight = np.exp(DATA["old_logps"] - DATA["behavior_logps"].astype(np.float64))[MASK]
    assert (weight > TIS_CAP).any() and (weight < TIS_CAP).any()
    assert len(set(MASK.sum(1))) >= 4 and not MASK[2].any()


@pytest.mark.parametrize("tis", [False, True], ids=["", "tis"])
@pytest.mark.parametrize("kl", [False, True], ids=["", "kl"])
@pytest.mark.parametrize("kind", LOSSES)
def test_loss_and_metrics_match_numpy(kind, kl, tis):
    ours, theirs = _options(kind, kl, tis)
    loss, metrics = policy_loss(*_args(), **ours)
    want, want_metrics = _reference(*_args(), **theirs)
    # Some units take the clipped branch and some the unclipped one.
    assert 0 < want_metrics["clip_fraction"] < 1
    assert loss.shape == () and loss.dtype == jnp.float32
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    assert set(metrics) == set(want_metrics)
    for name, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[name]), value, rtol=1e-5, err_msg=name)
    assert (float(metrics["kl"]) > 0) == kl


@pytest.mark.parametrize("kind", LOSSES)
def test_explicit_asymmetric_clip_matches_numpy(kind):
    ours, theirs = _options(kind, kl=False, tis=False)
    clip = (0.1, 0.3) if kind != "gspo" else (0.02, 0.09)
    loss, metrics = policy_loss(*_args(), clip_low=clip[0], clip_high=clip[1], **ours)
    want, want_metrics = _reference(*_args(), clip=clip, **theirs)
    np.testing.assert_allclose(float(loss), want, rtol=1e-5)
    np.testing.assert_allclose(float(metrics["clip_fraction"]), want_metrics["clip_fraction"])
    # The data tell the two bounds apart: swapping them changes the loss and the clipping.
    swapped, swapped_metrics = _reference(*_args(), clip=clip[::-1], **theirs)
    assert abs(swapped - want) > 1e-3
    assert swapped_metrics["clip_fraction"] != want_metrics["clip_fraction"]


def _numeric_grad(f, x, step=1e-6):
    """Central finite differences of scalar f at float64 x."""
    x = np.asarray(x, np.float64)
    grad = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        up, down = x.copy(), x.copy()
        up[idx] += step
        down[idx] -= step
        grad[idx] = (f(up) - f(down)) / (2 * step)
    return grad


@pytest.mark.parametrize("tis", [False, True], ids=["", "tis"])
@pytest.mark.parametrize("kind", LOSSES)
def test_gradient_matches_finite_differences(kind, tis):
    ours, theirs = _options(kind, kl=True, tis=tis)
    _, old, adv, mask = _args()
    grad = jax.grad(lambda lp: policy_loss(lp, old, adv, mask, **ours)[0])(DATA["logps"])
    grad = np.asarray(grad)
    want = _numeric_grad(lambda lp: _reference(lp, old, adv, mask, **theirs)[0], DATA["logps"])
    np.testing.assert_allclose(grad, want, atol=1e-4)
    assert np.all(grad[~MASK] == 0.0)
    assert np.abs(grad[MASK]).min() > 0


@pytest.mark.parametrize("kind", LOSSES)
def test_masked_out_garbage_changes_nothing(kind):
    # +-50 on both sides of each difference: exp would overflow float32 if it reached one.
    sign = np.where(np.arange(B * T).reshape(B, T) % 2, 50.0, -50.0).astype(np.float32)
    dirty = {
        "logps": np.where(MASK, DATA["logps"], sign),
        "old_logps": np.where(MASK, DATA["old_logps"], -sign),
        "advantages": DATA["advantages"],
        "ref_logps": np.where(MASK, DATA["ref_logps"], -sign),
        "behavior_logps": np.where(MASK, DATA["behavior_logps"], sign),
    }

    def loss_and_grad(data, mask):
        ours, _ = _options(kind, kl=True, tis=True, data=data)
        _, old, adv, _ = _args(data)
        f = lambda lp: policy_loss(lp, old, adv, mask, **ours)[0]
        return jax.value_and_grad(f)(data["logps"])

    clean_loss, clean_grad = loss_and_grad(DATA, MASK)
    # The mask as 0/1 floats too.
    dirty_loss, dirty_grad = loss_and_grad(dirty, MASK.astype(np.float32))
    assert np.isfinite(float(clean_loss))
    np.testing.assert_allclose(float(dirty_loss), float(clean_loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(dirty_grad), np.asarray(clean_grad), rtol=1e-6)
    assert np.all(np.asarray(dirty_grad)[~MASK] == 0.0)


def test_on_policy_grpo_is_minus_the_mean_advantage():
    adv, has_tokens, count = DATA["advantages"], MASK.any(1), MASK.sum(1)
    f = lambda lp: policy_loss(lp, DATA["old_logps"], adv, MASK)[0]
    loss, grad = jax.value_and_grad(f)(DATA["old_logps"])
    # Rows without tokens count as 0 in the mean over all B rows.
    np.testing.assert_allclose(float(loss), -np.sum(adv * has_tokens) / B, rtol=1e-6)
    # The policy gradient: each token's share of its row's -A / B.
    want = np.where(MASK, -adv[:, None] / (np.maximum(count, 1)[:, None] * B), 0.0)
    np.testing.assert_allclose(np.asarray(grad), want, rtol=1e-6)


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"kind": "ppo"}, "kind"),
        ({"kind": "dr_grpo"}, "max_tokens"),
        ({"kl_beta": 0.1}, "ref_logps"),
        ({"tis_cap": 2.0}, "behavior_logps"),
        ({"tis_cap": 0.0, "behavior_logps": DATA["behavior_logps"]}, "tis_cap"),
        ({"clip_low": -0.1}, "clip_low"),
    ],
)
def test_errors_name_the_argument(options, name):
    with pytest.raises(ValueError, match=name):
        policy_loss(*_args(), **options)


def test_unknown_kind_lists_the_choices():
    with pytest.raises(ValueError, match="grpo, dr_grpo, dapo, gspo"):
        policy_loss(*_args(), kind="ppo")


# Rollout scoring.


@pytest.mark.parametrize("scale", ["std", "none"])
def test_group_advantages_match_numpy(scale):
    rng = np.random.default_rng(1)
    rewards, group = rng.normal(0.0, 1.0, 12), 4
    got = group_advantages(rewards, group, scale=scale)
    assert got.dtype == np.float32 and got.shape == (12,)
    for g in range(3):
        r = rewards[g * group : (g + 1) * group]
        mean = sum(r) / group
        want = r - mean
        if scale == "std":
            want = want / (math.sqrt(sum((x - mean) ** 2 for x in r) / (group - 1)) + 1e-4)
        np.testing.assert_allclose(got[g * group : (g + 1) * group], want, rtol=1e-6)


def test_identical_rewards_give_zero_advantages():
    rewards = np.array([1.0, 1.0, 1.0, 0.0, 1.0, 0.0])
    for scale in ("std", "none"):
        got = group_advantages(rewards, 3, scale=scale)
        assert np.all(np.isfinite(got)) and np.all(got[:3] == 0.0) and np.all(got[3:] != 0.0)
    assert np.all(group_advantages([0.5, 2.0], 1) == 0.0)


def test_varied_groups():
    rewards = [1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.5, 0.5]
    assert varied_groups(rewards, 2).tolist() == [False, False, True, False]
    assert varied_groups(rewards, 4).tolist() == [True, True]


def test_advantage_errors():
    with pytest.raises(ValueError, match="scale"):
        group_advantages([1.0, 2.0], 2, scale="max")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages([1.0, 2.0, 3.0], 2)
    with pytest.raises(ValueError, match="group_size"):
        varied_groups([1.0, 2.0], 0)
    with pytest.raises(ValueError, match="cache_tokens"):
        overlong_penalty([3], 10, 11)
    with pytest.raises(ValueError, match="cache_tokens"):
        overlong_penalty([3], 10, -1)


def test_overlong_penalty_regimes():
    lengths = [0, 5, 6, 7, 8, 10, 11, 40]
    # L_max = 10, L_cache = 4: free up to 6, a ramp to -1 at 10, then -1.
    got = overlong_penalty(lengths, 10, 4)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [0, 0, 0, -0.25, -0.5, -1, -1, -1], atol=1e-7)
    np.testing.assert_allclose(overlong_penalty([10, 11], 10, 0), [0, -1])


def test_pass_at_k_matches_the_combinatorial_formula():
    for n, c, k in [(10, 3, 1), (10, 3, 5), (20, 1, 10), (100, 37, 16), (200, 150, 50)]:
        want = 1 - math.comb(n - c, k) / math.comb(n, k)
        assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12)
    assert pass_at_k(10, 3, 1) == pytest.approx(0.3)


def test_pass_at_k_edges():
    assert pass_at_k(10, 0, 3) == 0.0
    assert pass_at_k(10, 8, 3) == 1.0
    assert pass_at_k(5, 5, 5) == 1.0
    for k in (0, 6):
        with pytest.raises(ValueError, match="k"):
            pass_at_k(5, 2, k)
