"""Chunked logprobs: the same values and gradients as the dense log-softmax, with at most
one chunk of fp32 logits alive (measured with saved-tensor hooks), and the model's
output projection swapped only for the duration of one forward."""

import pytest
import torch

from areal_ray.algo.logprobs import (
    chunked_logprobs,
    logprob_head,
    shared_model_logprobs,
    token_logprobs,
)
from areal_ray.train.memory import saved_storages


def dense(h, w, b, t, temp):
    logits = torch.nn.functional.linear(h, w, b).float() / temp
    return torch.log_softmax(logits, -1).gather(-1, t.unsqueeze(-1)).squeeze(-1)


def saved_bytes(fn):
    """(fn(), largest, total) bytes of the storages autograd keeps for the backward."""
    out, sizes = saved_storages(fn)
    return out, max(sizes), sum(sizes)


@pytest.mark.parametrize("chunk_rows", [1, 3, 7, 100])
@pytest.mark.parametrize("bias", [False, True])
def test_chunked_values_and_gradients_match_the_dense_computation(chunk_rows, bias):
    torch.manual_seed(0)
    V, H = 50, 8
    h = torch.randn(2, 7, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    b = torch.randn(V, requires_grad=True) if bias else None
    t = torch.randint(0, V, (2, 7))
    ref = dense(h, w, b, t, 0.7)
    got = chunked_logprobs(h, w, b, t, 0.7, chunk_bytes=chunk_rows * V * 4)
    assert got.shape == (2, 7)
    torch.testing.assert_close(got, ref)
    g_ref = torch.autograd.grad((ref * torch.arange(14.).view(2, 7)).sum(), [h, w])
    g_got = torch.autograd.grad((got * torch.arange(14.).view(2, 7)).sum(), [h, w])
    for a, c in zip(g_got, g_ref):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-4)  # fp32 summation order


def test_at_most_one_chunk_of_logits_is_kept_for_the_backward():
    torch.manual_seed(0)
    V, H, N = 4096, 16, 512
    h = torch.randn(N, H, requires_grad=True)
    w = torch.randn(V, H, requires_grad=True)
    t = torch.randint(0, V, (N,))
    full = N * V * 4
    _, biggest_dense, _ = saved_bytes(lambda: dense(h, w, None, t, 1.0))
    assert biggest_dense >= full  # the whole micro-batch's fp32 logits
    chunk = 64 * V * 4
    out, biggest, total = saved_bytes(lambda: chunked_logprobs(h, w, None, t, 1.0, chunk))
    assert biggest <= max(h.untyped_storage().nbytes(), w.untyped_storage().nbytes())
    assert total < full / 4
    out.sum().backward()  # the chunks are recomputed
    assert h.grad is not None and torch.isfinite(h.grad).all()


def test_token_logprobs_match_the_models_own_logits(random_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    ids = torch.tensor([[3, 5, 7, 9, 11], [4, 6, 8, 10, 12]])
    mask = torch.ones_like(ids)
    ref = torch.log_softmax(model(input_ids=ids, attention_mask=mask).logits[:, :-1].float() / 0.8, -1)
    ref = ref.gather(-1, ids[:, 1:, None]).squeeze(-1)
    vocab = model.config.vocab_size
    for chunk in (vocab * 4, 3 * vocab * 4, 1 << 30):
        torch.testing.assert_close(token_logprobs(model, ids, mask, 0.8, chunk), ref)
    head = model.get_output_embeddings()
    assert "forward" not in head.__dict__  # restored
    assert model(input_ids=ids).logits.shape[-1] == vocab


def test_shared_model_logprobs_equal_the_trainers_and_leave_the_model_as_others_see_it(random_model_dir):
    """An engine scores its load probe beside its scheduler's forwards: the scheduler's
    forward, run while the probe is mid-forward (here from a hook, as another thread
    would), must still get the model's own vocabulary logits, and the probe the
    trainer's bits."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    ids = torch.tensor([[3, 5, 7, 9, 11], [4, 6, 8, 10, 12]])
    seen, busy = [], []

    def scheduler_forward(module, args, kwargs):
        if not busy:
            busy.append(True)
            seen.append(model(input_ids=ids[:1, :2], logits_to_keep=1).logits.shape)
    model.get_decoder().register_forward_pre_hook(scheduler_forward, with_kwargs=True)
    with torch.no_grad():
        got = shared_model_logprobs(model, ids, torch.ones_like(ids))
    assert seen == [torch.Size([1, 1, model.config.vocab_size])]
    with torch.no_grad():
        assert torch.equal(got, token_logprobs(model, ids, torch.ones_like(ids)))


def test_the_head_is_restored_when_the_forward_fails_and_softcapping_is_refused(random_model_dir):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(random_model_dir)
    ids = torch.tensor([[3, 5, 7]])
    with pytest.raises(RuntimeError):
        with logprob_head(model, ids, 1.0, 1 << 20):
            raise RuntimeError("forward failed")
    assert "forward" not in model.get_output_embeddings().__dict__
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ValueError, match="caps its logits"):
        with logprob_head(model, ids, 1.0, 1 << 20):
            pass
