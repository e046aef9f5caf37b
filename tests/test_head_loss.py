"""Tests of spes.head_loss: `fused_loss`'s chunked head gives the whole logits' loss and gradients (fp32 and bf16
autocast, ignored labels, a short last chunk), computes each chunk once with one cast of the weight, does no
gradient work when none is wanted, and refuses a second backward instead of scaling twice."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

import spes.head_loss
from spes.head_loss import IGNORE_INDEX, ChunkFns, chunk_loss_grads, head_loss_sums, logit_loss_sums

Z = 1e-2  # a logit z-loss weight large enough for its gradient to show


def inputs(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """40 tokens of width 16 over a 50-entry vocabulary, three labels ignored."""
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(40, 16, generator=gen, requires_grad=True)
    w = torch.randn(50, 16, generator=gen, requires_grad=True)
    labels = torch.randint(0, 50, (40,), generator=gen)
    labels[[3, 17, 39]] = IGNORE_INDEX
    return h, w, labels


def whole_logits(
    h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, z_weight: float | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, ce, z) of the whole logits, as the plain path computes them."""
    ce, z = logit_loss_sums(F.linear(h, w), labels, logit_z=z_weight is not None)
    return ce + (z_weight or 0.0) * z, ce, z


@contextlib.contextmanager
def made_like() -> Iterator[list[tuple[int, ...]]]:
    """The shapes of the tensors made by `torch.empty_like` and `torch.zeros_like` meanwhile (the gradient buffers)."""
    made: list[tuple[int, ...]] = []
    originals = torch.empty_like, torch.zeros_like

    def recording(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def make(t: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
            made.append(tuple(t.shape))
            return original(t, *args, **kwargs)

        return make

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch, "empty_like", recording(originals[0]))
        patch.setattr(torch, "zeros_like", recording(originals[1]))
        yield made


@pytest.fixture
def chunks_of_7(monkeypatch: pytest.MonkeyPatch) -> int:
    """Chunks of 7 tokens over the 50-entry vocabulary: 6 chunks of 40 tokens, the last one short."""
    monkeypatch.setattr(spes.head_loss, "LOSS_CHUNK_ELEMENTS", 7 * 50)
    return -(-40 // 7)


@pytest.mark.parametrize("z_weight", [None, 0.0, Z])
def test_chunked_loss_and_gradients_are_the_whole_logits(chunks_of_7: int, z_weight: float | None) -> None:
    h, w, labels = inputs(0)
    got = head_loss_sums(h, w, labels, logit_z_weight=z_weight)
    want = whole_logits(h, w, labels, z_weight)
    torch.testing.assert_close(got, want)
    assert not got[1].requires_grad and not got[2].requires_grad
    torch.testing.assert_close(torch.autograd.grad(3 * got[0], (h, w)), torch.autograd.grad(3 * want[0], (h, w)))


def test_chunk_gradient_is_autograds_of_the_chunks_loss() -> None:
    """The formula of `chunk_loss_grads` against autograd through `logit_loss_sums`, ignored labels included."""
    h, w, labels = inputs(1)
    logits = F.linear(h, w).detach().requires_grad_()
    ce, z = logit_loss_sums(logits, labels, logit_z=True)
    (want,) = torch.autograd.grad(ce + Z * z, logits)
    got_ce, got_z, got = chunk_loss_grads(h.detach(), w.detach(), labels, Z)
    torch.testing.assert_close((got_ce, got_z, got), (ce, z, want))
    assert bool((got[[3, 17, 39]] == 0).all())


def test_under_autocast_each_chunk_is_computed_once_with_one_cast_of_the_weight(chunks_of_7: int) -> None:
    """Under bf16 autocast every chunk gets the one bf16 copy of the weight, no chunk is computed twice (the
    gradient comes with the loss), and the loss and gradients are the whole logits' under the same autocast to
    bf16's precision; the weight's gradient comes back in the weight's own dtype."""
    h, w, labels = inputs(2)
    seen: list[torch.Tensor] = []

    def recording(h_c: torch.Tensor, w_c: torch.Tensor, labels_c: torch.Tensor, z_weight: float | None) -> tuple:
        seen.append(w_c)
        return chunk_loss_grads(h_c, w_c, labels_c, z_weight)

    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss, ce, z = head_loss_sums(h, w, labels, logit_z_weight=Z, chunk_fns=ChunkFns(grads=recording))
        got = torch.autograd.grad(loss, (h, w))
        want_loss, want_ce, want_z = whole_logits(h, w, labels, Z)
        want = torch.autograd.grad(want_loss, (h, w))
    assert len(seen) == chunks_of_7 and all(t.dtype == torch.bfloat16 for t in seen)
    assert len({id(t) for t in seen}) == 1
    torch.testing.assert_close((ce, z), (want_ce, want_z))
    assert got[0].dtype == got[1].dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


def test_no_gradient_work_when_none_is_wanted(chunks_of_7: int) -> None:
    """Under no_grad, or with inputs that want no gradient, only the sums are computed; where only the hidden
    states want one, the weight gets none."""

    def refused(*_: object) -> tuple:
        raise AssertionError("a gradient was computed that nobody wants")

    h, w, labels = inputs(3)
    want = whole_logits(h, w, labels, Z)
    with torch.no_grad():
        got = head_loss_sums(h, w, labels, logit_z_weight=Z, chunk_fns=ChunkFns(grads=refused))
        torch.testing.assert_close(got, want)
        got = head_loss_sums(h, w, labels, logit_z_weight=0.0, chunk_fns=ChunkFns(grads=refused))
        torch.testing.assert_close(got, whole_logits(h, w, labels, 0.0))
    got = head_loss_sums(h.detach(), w.detach(), labels, logit_z_weight=Z, chunk_fns=ChunkFns(grads=refused))
    torch.testing.assert_close(got, want)
    with made_like() as made:
        loss, _, _ = head_loss_sums(h, w.detach(), labels, logit_z_weight=Z)
    assert (40, 16) in made and (50, 16) not in made  # no buffer for a gradient nobody wants
    loss.backward()
    assert w.grad is None and h.grad is not None
    torch.testing.assert_close(h.grad, torch.autograd.grad(want[0], h)[0])


def test_a_second_backward_is_refused_not_scaled_twice() -> None:
    h, w, labels = inputs(4)
    loss, _, _ = head_loss_sums(h, w, labels, logit_z_weight=None)
    (2 * loss).backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_the_fp32_accumulating_gemm_call_is_well_formed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path of `_add_product` (bf16 operands into an fp32 sum by addmm's out_dtype) checked for its
    signature, shapes and dtypes on the meta device, since only a GPU runs it."""
    monkeypatch.setattr(spes.head_loss, "_gemm_accumulates_fp32", lambda *_: True)
    out = torch.empty(50, 16, device="meta")
    a, b = (
        torch.empty(50, 7, dtype=torch.bfloat16, device="meta"),
        torch.empty(7, 16, dtype=torch.bfloat16, device="meta"),
    )
    spes.head_loss._add_product(out, a, b)
    assert out.dtype == torch.float32 and out.shape == (50, 16)


@pytest.mark.gpu
def test_on_a_gpu_the_weight_gradient_is_accumulated_in_fp32_inside_the_gemm(chunks_of_7: int) -> None:
    """On CUDA under bf16 autocast each chunk's weight gradient is added into the fp32 sum by the GEMM itself
    (addmm's out_dtype), and the loss and gradients are the whole logits' to bf16's precision."""
    h, w, labels = (t.cuda() for t in inputs(5))
    h, w = h.detach().requires_grad_(), w.detach().requires_grad_()
    assert spes.head_loss._gemm_accumulates_fp32(torch.zeros(2, device="cuda"), h.bfloat16())
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss, ce, z = head_loss_sums(h, w, labels, logit_z_weight=Z)
        got = torch.autograd.grad(loss, (h, w))
        want_loss, want_ce, want_z = whole_logits(h, w, labels, Z)
        want = torch.autograd.grad(want_loss, (h, w))
    # NOTE: a GEMM of 7 rows and one of 40 may round some bf16 logits apart on a GPU
    torch.testing.assert_close((ce, z), (want_ce, want_z), rtol=1e-3, atol=1e-3)
    assert got[1].dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(("elements", "sizes"), [(7 * 50, [7] * 5 + [5]), (10, [1] * 40)])
def test_a_chunk_holds_loss_chunk_elements_logits_at_least_one_token(
    monkeypatch: pytest.MonkeyPatch, elements: int, sizes: list[int]
) -> None:
    """A chunk is `LOSS_CHUNK_ELEMENTS` // V tokens (the memory bound `fused_loss` promises), one token when the
    vocabulary alone is larger; with and without a gradient wanted."""
    monkeypatch.setattr(spes.head_loss, "LOSS_CHUNK_ELEMENTS", elements)
    seen: dict[str, list[int]] = {"sums": [], "grads": []}

    def sums(h_c: torch.Tensor, *rest: object) -> tuple:
        seen["sums"].append(len(h_c))
        return spes.head_loss.chunk_loss_sums(h_c, *rest)  # type: ignore[arg-type]

    def grads(h_c: torch.Tensor, *rest: object) -> tuple:
        seen["grads"].append(len(h_c))
        return chunk_loss_grads(h_c, *rest)  # type: ignore[arg-type]

    h, w, labels = inputs(6)
    fns = ChunkFns(sums, grads)
    with torch.no_grad():
        head_loss_sums(h, w, labels, logit_z_weight=Z, chunk_fns=fns)
    head_loss_sums(h, w, labels, logit_z_weight=Z, chunk_fns=fns)
    assert seen == {"sums": sizes, "grads": sizes}


def test_only_the_weight_wanting_a_gradient_gets_the_whole_logits_one(chunks_of_7: int) -> None:
    """Hidden states that want no gradient (a frozen trunk) still give the head's weight its gradient."""
    h, w, labels = inputs(7)
    with made_like() as made:
        loss, _, _ = head_loss_sums(h.detach(), w, labels, logit_z_weight=Z)
    assert (50, 16) in made and (40, 16) not in made
    loss.backward()
    assert h.grad is None
    torch.testing.assert_close(w.grad, torch.autograd.grad(whole_logits(h.detach(), w, labels, Z)[0], w)[0])


def test_compiled_chunk_fns_compute_what_the_plain_ones_do(chunks_of_7: int) -> None:
    """`ChunkFns.compiled` (what `compile` gives the model's head) compiles both functions with the options given
    (here a backend that records the graphs it is handed and runs them as traced)."""
    graphs: list[int] = []

    def recording(gm: torch.fx.GraphModule, example_inputs: list[torch.Tensor]) -> object:
        graphs.append(len(example_inputs))
        return gm.forward

    fns = ChunkFns().compiled(backend=recording, dynamic=False)
    h, w, labels = inputs(8)
    got = head_loss_sums(h, w, labels, logit_z_weight=Z, chunk_fns=fns)
    assert graphs, "the gradient's chunk function was not compiled with the options given"
    torch.testing.assert_close(got, whole_logits(h, w, labels, Z))
    traced = len(graphs)
    with torch.no_grad():
        torch.testing.assert_close(head_loss_sums(h, w, labels, logit_z_weight=Z, chunk_fns=fns), got)
    assert len(graphs) > traced, "the sums' chunk function was not compiled with the options given"


def test_a_bf16_weights_gradient_is_summed_over_the_chunks_in_fp32(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bf16 head without autocast, one token a chunk: its gradient is the sum of the chunks' own (bf16) products
    rounded once, to bf16, at the end: within half a bf16 step (2^-8 of the value) of that sum in fp64. Summed in
    bf16 instead, 63 roundings of the running sum missed it by up to twice the value."""
    monkeypatch.setattr(spes.head_loss, "LOSS_CHUNK_ELEMENTS", 50)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(64, 16, generator=gen).bfloat16()
    w = torch.randn(50, 16, generator=gen).bfloat16().requires_grad_()
    labels = torch.randint(0, 50, (64,), generator=gen)
    loss, _, _ = head_loss_sums(h, w, labels, logit_z_weight=None)
    (got,) = torch.autograd.grad(loss, w)
    want = torch.zeros(50, 16, dtype=torch.float64)
    for t in range(64):
        g_TV = chunk_loss_grads(h[t : t + 1], w.detach(), labels[t : t + 1], None)[2]
        want += (g_TV.T @ h[t : t + 1]).double()
    assert got.dtype == torch.bfloat16
    assert bool(((got.double() - want).abs() <= (2**-8 + 1e-5) * want.abs() + 1e-6).all())
