"""Error measures for the kernel tests that one missing piece of the answer cannot pass.

A relative Frobenius error over a whole tensor dilutes a local fault: a dropped routing slot moves
one token's row of y by the slot's share of it, which the whole tensor's error sees divided by about
sqrt(T); one token missing from an expert's weight gradient shows divided by about sqrt(N) (N the
routed rows of all experts). These measures look at the piece a fault lives in, where it is large:

- :func:`row_errors`: each row (token) of y or dx against its own norm. A dropped slot moves its
  token's row by its share s_k |out_k| / |sum_j s_j out_j|.
- :func:`expert_errors`: a weight gradient (E, A, B) per expert, and per row and per column of each
  expert's matrix. One token's rank-1 term of an expert's sum of n moves the expert's matrix by
  ~1/sqrt(n) and the row or column where that token's factor is largest by several times that; a
  zeroed row or column moves it by 100%.
- :func:`term_errors`: the routing-weight gradient, entries that are sums of terms that cancel
  (ds[t, k] = sum_f dA'[f] act[f]), entry by entry against the root sum of squares of their terms
  (:func:`routing_grad_terms`), the size their rounding error scales with.

Rows and lines take a floor, a fraction of the typical norm of their group (the median row norm
of the tensor, which a few x100 outlier tokens do not raise; the rms row or column norm of the
expert): a line whose reference is near zero (an expert's dW1 row from one token whose gate sits
where silu' crosses zero) keeps an error from its terms' rounding that its own norm no longer scales.

:class:`MoEBounds` holds the four bounds of an MoE op's output and gradients and checks them all;
each failure names the worst piece, its error and the whole tensor's. docs/testing.md ("Bounds that
catch a dropped slot") gives the error of correct code, the bounds and what faults measure.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

# A piece's norm is taken no smaller than this fraction of its group's typical norm.
FLOOR = 0.5


def _ratio(num: torch.Tensor, den: torch.Tensor) -> torch.Tensor:
    """num / den; where den is 0, 0 if num is too and inf otherwise."""
    return torch.where(den > 0, num / den.clamp_min(1e-300), torch.where(num > 0, float("inf"), 0.0))


def _median(norms: torch.Tensor, dim) -> torch.Tensor:
    """The median along ``dim`` (kept): a typical row norm, which a few outlier tokens do not move."""
    return norms.median(dim=dim, keepdim=True).values


def _rms(norms: torch.Tensor, dim) -> torch.Tensor:
    """The rms along ``dim`` (kept): an expert's lines share every token's rank-1 term, outliers' too."""
    return norms.square().mean(dim=dim, keepdim=True).sqrt()


def row_errors(got: torch.Tensor, ref: torch.Tensor, floor: float = FLOOR) -> torch.Tensor:
    """Relative error of each row (over the last dim) of a 2-D tensor, against max(the reference
    row's norm, ``floor`` x the median row norm), in float64."""
    g, r = got.detach().double(), ref.detach().double()
    den = torch.linalg.vector_norm(r, dim=-1)
    den = torch.maximum(den, floor * _median(den, 0)[0])
    return _ratio(torch.linalg.vector_norm(g - r, dim=-1), den)


def expert_errors(got: torch.Tensor, ref: torch.Tensor, floor: float = FLOOR) -> dict[str, torch.Tensor]:
    """A weight gradient (E, A, B): relative errors per expert (E,), per row (E, A) and per column
    (E, B), each row or column against max(its norm, ``floor`` x the expert's rms row or column norm)."""
    g, r = got.detach().double(), ref.detach().double()
    diff = g - r
    out = {"expert": _ratio(torch.linalg.vector_norm(diff, dim=(1, 2)), torch.linalg.vector_norm(r, dim=(1, 2)))}
    for name, dim in (("row", 2), ("column", 1)):
        den = torch.linalg.vector_norm(r, dim=dim)
        out[name] = _ratio(torch.linalg.vector_norm(diff, dim=dim), torch.maximum(den, floor * _rms(den, 1)))
    return out


def term_errors(got: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor) -> torch.Tensor:
    """|got - ref| / terms entry by entry, float64."""
    g, r = got.detach().double(), ref.detach().double()
    return _ratio((g - r).abs(), terms.detach().double())


def global_error(got: torch.Tensor, ref: torch.Tensor) -> float:
    """||got - ref|| / ||ref|| over the whole tensor, float64 (reported beside the worst piece)."""
    g, r = got.detach().double(), ref.detach().double()
    return ((g - r).norm() / r.norm().clamp_min(1e-300)).item()


def _assert_below(errors: torch.Tensor, bound: float, what: str, name: str, msg: str, whole: float) -> None:
    if errors.numel() == 0:
        return
    worst = int(errors.argmax())
    value = errors.flatten()[worst].item()
    index = tuple(int(i) for i in torch.unravel_index(torch.tensor(worst), errors.shape))
    assert value < bound, (f"{name}: {what} {index[0] if len(index) == 1 else index} has relative error "
                           f"{value:.2e} >= {bound:.1e} (whole tensor {whole:.2e}); {msg}")


def assert_rows_close(got: torch.Tensor, ref: torch.Tensor, rel: float, name: str, msg: str = "") -> None:
    """Every row of ``got`` (a token's y or dx; any 2-D tensor's rows) within ``rel`` of the reference
    row (:func:`row_errors`); the failure names the worst row."""
    assert torch.isfinite(got).all(), f"{name} not finite; {msg}"
    _assert_below(row_errors(got, ref), rel, "row", name, msg, global_error(got, ref))


def assert_experts_close(got: torch.Tensor, ref: torch.Tensor, rel: float, rel_lines: float, name: str,
                         msg: str = "") -> None:
    """A weight gradient (E, A, B): each expert's matrix within ``rel``, each of its rows and columns
    within ``rel_lines`` (:func:`expert_errors`); the failure names the worst one."""
    assert torch.isfinite(got).all(), f"{name} not finite; {msg}"
    whole = global_error(got, ref)
    errors = expert_errors(got, ref)
    _assert_below(errors["expert"], rel, "expert", name, msg, whole)
    _assert_below(errors["row"], rel_lines, "(expert, row)", name, msg, whole)
    _assert_below(errors["column"], rel_lines, "(expert, column)", name, msg, whole)


def assert_terms_close(got: torch.Tensor, ref: torch.Tensor, terms: torch.Tensor, rel: float, name: str,
                       msg: str = "") -> None:
    """Every entry within ``rel`` of the reference relative to the size of its terms
    (:func:`term_errors`); the failure names the worst entry."""
    assert torch.isfinite(got).all(), f"{name} not finite; {msg}"
    _assert_below(term_errors(got, ref, terms), rel, "entry", name, msg, global_error(got, ref))


def routing_grad_terms(x_TD, topk_ids_TK, w1_EFD, w3_EFD, w2_EDF, dy_TD) -> torch.Tensor:
    """(T, K) float64: ||dA' * act||_2 over F for each slot, with dA' = dy[t] @ w2[e] and
    act = silu(w1[e] x[t]) * (w3[e] x[t]) from the given (unquantized) operands; 0 for empty slots.
    ds[t, k] = sum_f dA'[f] act[f]: its rounding error scales with these terms, not with ds."""
    T, K = topk_ids_TK.shape
    x, w1, w3, w2, dy = (t.detach().double() for t in (x_TD, w1_EFD, w3_EFD, w2_EDF, dy_TD))
    ids_N = topk_ids_TK.reshape(-1)
    token_N = torch.arange(T * K, device=x.device) // K
    out = torch.zeros(T * K, dtype=torch.float64, device=x.device)
    for e in range(w1.shape[0]):
        rows = torch.nonzero(ids_N == e).flatten()
        x_e = x[token_N[rows]]
        act = F.silu(x_e @ w1[e].t()) * (x_e @ w3[e].t())
        out[rows] = ((dy[token_N[rows]] @ w2[e]) * act).norm(dim=1)
    return out.view(T, K)


@dataclasses.dataclass(frozen=True)
class MoEBounds:
    """Bounds of an MoE op against its reference, one per kind of piece (relative errors):
    ``rows``: each token's row of y and dx; ``expert``: each expert's dW1, dW3, dW2; ``lines``: each
    row and column of those; ``terms``: each routing-weight gradient against its terms."""

    rows: float
    expert: float
    lines: float
    terms: float

    def assert_close(self, y, grads, y_ref, ref_grads, terms_TK, msg: str = "") -> None:
        """y and grads = (dx, dtopk_weights, dw1, dw3, dw2) against the reference's; ``terms_TK``
        from :func:`routing_grad_terms`."""
        assert_rows_close(y, y_ref, self.rows, "y", msg)
        dx, ds, *dws = grads
        dx_ref, ds_ref, *dws_ref = ref_grads
        assert_rows_close(dx, dx_ref, self.rows, "dx", msg)
        assert_terms_close(ds, ds_ref, terms_TK, self.terms, "dtopk_weights", msg)
        for name, g, r in zip(("dw1", "dw3", "dw2"), dws, dws_ref):
            assert_experts_close(g, r, self.expert, self.lines, name, msg)
