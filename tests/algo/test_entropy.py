"""The token entropy beside the chunked logprobs: equal to a direct computation, with
the logprobs and their gradients bit-identical to the path without it, and no extra
fp32 logits kept for the backward."""

import pytest
import torch

from areal_ray.algo.logprobs import chunked_logprobs, token_logprobs
from tests.algo.test_logprobs import saved_bytes


def direct_entropy(h, w, b, temp):
    logits = torch.nn.functional.linear(h, w, b).float() / temp
    return torch.distributions.Categorical(logits=logits).entropy()


def inputs(bias=True, seed=0, V=50, H=8):
    torch.manual_seed(seed)
    h = torch.randn(2, 7, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True) if bias else None
    t = torch.randint(0, V, (2, 7))
    return h, w, b, t


@pytest.mark.parametrize("chunk_rows", [1, 3, 100])
@pytest.mark.parametrize("mode", ["value", "grad"])
def test_chunked_entropy_equals_the_direct_computation(chunk_rows, mode):
    h, w, b, t = inputs()
    out = chunked_logprobs(h, w, b, t, 0.7, chunk_bytes=chunk_rows * 50 * 4, entropy=mode)
    assert out.shape == (2, 7, 2)
    ref = direct_entropy(h, w, b, 0.7)
    torch.testing.assert_close(out[..., 1], ref)
    if mode == "grad":  # the bonus's gradient is the entropy's
        g_ref = torch.autograd.grad(ref.sum(), [h, w, b])
        g_got = torch.autograd.grad(out[..., 1].sum(), [h, w, b])
        for a, c in zip(g_got, g_ref):
            torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
    else:
        assert not torch.autograd.grad(out[..., 1].sum(), [h], allow_unused=True,
                                       materialize_grads=True)[0].any()


@pytest.mark.parametrize("chunk_rows", [1, 3, 100])
def test_the_logprobs_and_their_gradients_are_the_same_bits_with_the_entropy(chunk_rows):
    h, w, b, t = inputs()
    plain = chunked_logprobs(h, w, b, t, 0.7, chunk_bytes=chunk_rows * 50 * 4)
    both = chunked_logprobs(h, w, b, t, 0.7, chunk_bytes=chunk_rows * 50 * 4, entropy="value")
    assert torch.equal(plain, both[..., 0])
    weights = torch.arange(14.).view(2, 7)
    g_plain = torch.autograd.grad((plain * weights).sum(), [h, w, b])
    g_both = torch.autograd.grad((both[..., 0] * weights).sum(), [h, w, b])
    for a, c in zip(g_plain, g_both):
        assert torch.equal(a, c)


def test_the_entropy_keeps_no_extra_logits_for_the_backward():
    """Per chunk the entropy needs the probabilities of that chunk only: what autograd
    keeps stays far below one micro-batch's fp32 logits, as for the logprobs alone."""
    torch.manual_seed(0)
    V, H, N = 4096, 16, 512
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    t = torch.randint(0, V, (N,))
    chunk = 64 * V * 4
    for mode in ("value", "grad"):
        out, biggest, total = saved_bytes(lambda m=mode: chunked_logprobs(h, w, None, t, 1.0, chunk, m))
        assert biggest <= max(h.untyped_storage().nbytes(), w.untyped_storage().nbytes())
        assert total < N * V * 4 / 4
        out.sum().backward()


def test_a_model_forward_returns_both_from_one_pass(random_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    ids = torch.tensor([[3, 5, 7, 9, 11], [4, 6, 8, 10, 12]])
    mask = torch.ones_like(ids)
    calls = []
    model.register_forward_hook(lambda *_: calls.append(1))
    out = token_logprobs(model, ids, mask, 0.8, entropy="value")
    assert len(calls) == 1 and out.shape == (2, 4, 2)
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / 0.8
    torch.testing.assert_close(out[..., 1], torch.distributions.Categorical(logits=logits).entropy())
    torch.testing.assert_close(out[..., 0], token_logprobs(model, ids, mask, 0.8))
