"""Loss and advantage math against numbers computed by hand (trainer/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import (
    compute_advantages,
    entropy_from_logits,
    gather_logprobs,
    k3_kl,
    policy_loss,
)


def _adv(method: str, *, reward: list[float], has_reward: list[bool], teacher: list[list[float]],
         has_teacher: list[bool], rollout: list[list[float]], w_rl: float = 1.0,
         w_opd: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    return compute_advantages(
        method=method, w_rl=w_rl, w_opd=w_opd, reward=torch.tensor(reward),
        has_reward=torch.tensor(has_reward), teacher_logp=torch.tensor(teacher),
        has_teacher=torch.tensor(has_teacher), rollout_logp=torch.tensor(rollout))


# Two samples, two tokens. Sample 0: reward −1 and a teacher; sample 1: reward NULL (value
# 5.0 is garbage that must be ignored) and a teacher NULL (garbage 9.0 ignored).
ROLLOUT = [[-1.0, -2.0], [-0.5, -0.5]]
TEACHER = [[-0.5, -3.0], [9.0, 9.0]]


@pytest.mark.parametrize(("method", "expected", "signal"), [
    # rl: A = w_rl·r broadcast; sample 1 has no reward -> no signal, A = 0
    ("rl", [[-2.0, -2.0], [0.0, 0.0]], [True, False]),
    # opd: A = w_opd·(teacher − rollout) = 0.5·(+0.5, −1.0)
    ("opd", [[0.25, -0.5], [0.0, 0.0]], [True, False]),
    # combine: −2 + (0.25, −0.5)
    ("combine", [[-1.75, -2.5], [0.0, 0.0]], [True, False]),
])
def test_advantages_per_method_with_null_reward_and_teacher(
        method: str, expected: list[list[float]], signal: list[bool]) -> None:
    adv, has_signal = _adv(method, reward=[-1.0, 5.0], has_reward=[True, False],
                           teacher=TEACHER, has_teacher=[True, False], rollout=ROLLOUT,
                           w_rl=2.0, w_opd=0.5)
    assert torch.allclose(adv, torch.tensor(expected))
    assert has_signal.tolist() == signal


def test_zero_reward_is_a_signal_but_null_is_not() -> None:
    adv, sig = _adv("rl", reward=[0.0, 0.0], has_reward=[True, False], teacher=TEACHER,
                    has_teacher=[False, False], rollout=ROLLOUT)
    assert sig.tolist() == [True, False]
    assert torch.count_nonzero(adv) == 0


def test_teacher_only_sample_has_no_signal_under_rl_but_has_under_opd() -> None:
    kwargs = dict(reward=[0.0], has_reward=[False], teacher=[[-1.0]], has_teacher=[True],
                  rollout=[[-2.0]])
    assert _adv("rl", **kwargs)[1].tolist() == [False]  # type: ignore[arg-type]
    adv, sig = _adv("opd", **kwargs)  # type: ignore[arg-type]
    assert sig.tolist() == [True] and adv.item() == pytest.approx(1.0)


def test_unknown_method_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown method"):
        _adv("ppo", reward=[1.0], has_reward=[True], teacher=[[0.0]], has_teacher=[False],
             rollout=[[0.0]])


def _loss(logp_new: list[float], rollout: list[float], adv: list[float], mask: list[float],
          **kw: float) -> tuple[float, torch.Tensor]:
    new = torch.tensor([logp_new], requires_grad=True)
    terms = policy_loss(logp_new=new, rollout_logp=torch.tensor([rollout]),
                        advantages=torch.tensor([adv]), mask=torch.tensor([mask]),
                        num_tokens=int(sum(mask)), eps_low=0.2, eps_high=0.28, **kw)
    terms.loss.backward()
    assert new.grad is not None
    return float(terms.loss.detach()), new.grad[0]


def test_ratio_one_gives_minus_mean_advantage_and_grad_minus_a_over_n() -> None:
    loss, grad = _loss([-1.0, -2.0, -3.0], [-1.0, -2.0, -3.0], [1.0, -2.0, 4.0], [1, 1, 1])
    assert loss == pytest.approx(-(1.0 - 2.0 + 4.0) / 3)
    # d(−ratio·A/n)/d logp_new = −ratio·A/n, ratio = 1
    assert torch.allclose(grad, torch.tensor([-1 / 3, 2 / 3, -4 / 3]))


def test_high_clip_for_positive_advantage() -> None:
    # ratio = e^0.5 ≈ 1.6487 > 1.28, A = +1: min(1.6487, 1.28) = 1.28 -> loss −1.28, no grad.
    loss, grad = _loss([-0.5], [-1.0], [1.0], [1])
    assert loss == pytest.approx(-1.28)
    assert grad.item() == 0.0
    # Same ratio, A = −1: the unclipped term (−1.6487) is the min -> loss +1.6487, grad flows.
    loss, grad = _loss([-0.5], [-1.0], [-1.0], [1])
    assert loss == pytest.approx(math.exp(0.5))
    assert grad.item() == pytest.approx(math.exp(0.5))


def test_low_clip_for_negative_advantage() -> None:
    # ratio = e^−0.5 ≈ 0.6065 < 0.8, A = −1: min(−0.6065, −0.8) = −0.8 -> loss 0.8, no grad.
    loss, grad = _loss([-1.5], [-1.0], [-1.0], [1])
    assert loss == pytest.approx(0.8)
    assert grad.item() == 0.0
    # Same ratio, A = +1: min(0.6065, 0.8) = 0.6065 unclipped -> loss −0.6065, grad −0.6065.
    loss, grad = _loss([-1.5], [-1.0], [1.0], [1])
    assert loss == pytest.approx(-math.exp(-0.5))
    assert grad.item() == pytest.approx(-math.exp(-0.5))


def test_inside_the_asymmetric_band_nothing_is_clipped() -> None:
    # ratio = e^0.2 ≈ 1.2214 is inside (0.8, 1.28): loss = −1.2214 for A = +1.
    loss, _ = _loss([-0.8], [-1.0], [1.0], [1])
    assert loss == pytest.approx(-math.exp(0.2))


def test_mask_excludes_tokens_and_garbage_in_padding_cannot_nan() -> None:
    # Token 1 is padding with an absurd log ratio (1000 -> exp overflows to inf).
    loss, grad = _loss([-1.0, 999.0], [-1.0, -1.0], [2.0, 1.0], [1, 0])
    assert loss == pytest.approx(-2.0)
    assert grad.tolist() == [-2.0, 0.0]


def test_token_mean_uses_the_batch_token_count() -> None:
    # Micro batch of 1 token while the batch has 4 tokens: the loss is scaled by 1/4.
    terms = policy_loss(logp_new=torch.tensor([[-1.0]]), rollout_logp=torch.tensor([[-1.0]]),
                        advantages=torch.tensor([[2.0]]), mask=torch.tensor([[1.0]]),
                        num_tokens=4, eps_low=0.2, eps_high=0.28)
    assert float(terms.loss) == pytest.approx(-0.5)


def test_k3_kl_by_hand_and_added_with_coefficient() -> None:
    # d = ref − new = −1 − (−2) = 1: e^1 − 1 − 1 = 0.71828
    assert k3_kl(torch.tensor(-2.0), torch.tensor(-1.0)).item() == pytest.approx(math.e - 2)
    assert k3_kl(torch.tensor(-1.0), torch.tensor(-1.0)).item() == 0.0
    loss, _ = _loss([-2.0], [-2.0], [0.0], [1], logp_ref=torch.tensor([[-1.0]]), kl_coef=0.1)
    assert loss == pytest.approx(0.1 * (math.e - 2))


def test_entropy_bonus_lowers_the_loss() -> None:
    ent = torch.tensor([[0.7, 0.3]])
    loss, _ = _loss([-1.0, -1.0], [-1.0, -1.0], [0.0, 0.0], [1, 1], entropy=ent,
                    entropy_coef=0.5)
    assert loss == pytest.approx(-0.5 * (0.7 + 0.3) / 2)


def test_gather_logprobs_shifts_exactly_once() -> None:
    # Vocab 3. Position 0 logits favour token 2, position 1 favours token 0.
    logits = torch.tensor([[[0.0, 0.0, math.log(2.0)], [math.log(3.0), 0.0, 0.0], [0.0, 0.0, 0.0]]])
    ids = torch.tensor([[1, 2, 0]])
    lp = gather_logprobs(logits, ids)
    # column 0: p(ids[1]=2 | pos 0) = 2/4; column 1: p(ids[2]=0 | pos 1) = 3/5
    assert lp.shape == (1, 2)
    assert torch.allclose(lp, torch.log(torch.tensor([[0.5, 0.6]])))


def test_entropy_of_uniform_is_log_vocab() -> None:
    ent = entropy_from_logits(torch.zeros(1, 3, 4))
    assert ent.shape == (1, 2)
    assert torch.allclose(ent, torch.full((1, 2), math.log(4)))
