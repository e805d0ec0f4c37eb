"""The four Pallas Mosaic TPU kernels of chunked KDA and the builder that turns a plan `Stage`
into a `pallas_call`.

Per chunk n of one (batch, head), with G the chunk-local cumsum of g, Gam = carry * exp(G)
(carry = no segment start yet in this chunk), E = [same segment as the last row] exp(G_last - G),
M[r, c] = [same segment], decay = carry_last exp(G_last) [K]. Per-token and per-chunk vectors
(beta, segment counts, decay, their gradients) travel as [1, N] rows (a [.., N, 1] column would be
padded 128x in HBM) and are turned into columns in VMEM:
  fwd_prepare (parallel):  Aqk = scale (decayed q k^T) * tril * M;  L = beta (decayed k k^T) * stril * M;
                           Ai = (I + L)^-1;  w = Ai (beta k Gam);  u = Ai (beta v);  qg = scale q Gam;  kg = k E
  fwd_state (serial in n): hs[n] = S;  vn = u - w S;  o = qg S + Aqk vn;  S = decay * S + kg^T vn
  bwd_state (serial, n reversed): dh[n] = dS;  dvn = Aqk^T do + kg dS;  dS = decay * dS + qg^T do - w^T dvn
  bwd_chunk (parallel):    every input gradient of the chunk from (hs[n], dh[n], vn, dvn, do).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from kernels.kda.pallas_tpu_intra import F32, NN, NT, TN, decayed_apply, decayed_scores, iota, mm, unit_lower_inverse


def _index_map(op, layout: str, nt: int, reverse: bool):
    chunk = (lambda n: nt - 1 - n) if reverse else (lambda n: n)
    kind = op.index
    if kind == "tok" and layout == "flat":
        return lambda b, h, n: (b, chunk(n), h)
    if kind == "tok":
        return lambda b, h, n: (b, h, chunk(n), 0)
    if kind == "seg_row":
        return lambda b, h, n: (b, chunk(n), 0, 0)
    if kind == "chunk":
        return lambda b, h, n: (b, h, chunk(n), 0, 0)
    if kind == "head":
        return lambda b, h, n: (b, h, 0, 0)
    raise ValueError(f"Unknown operand index kind {kind!r}; expected one of tok, seg_row, chunk, head")


def run_stage(stage, plan, body_name, params, args, interpret):
    """Run kernel `body_name` (with static `params`) over the stage's grid, BlockSpecs from the plan."""
    return _stage_call(stage, plan.layout, plan.NT, body_name, tuple(sorted(params.items())), interpret)(*args)


@functools.cache
def _stage_call(stage, layout, nt, body_name, params, interpret):
    """One jitted pallas_call per (stage, kernel, params): eager calls of equal shapes reuse its
    compilation (a fresh pallas_call would be traced and, in interpret mode, compiled again)."""
    spec = lambda op: pl.BlockSpec(op.block_shape, _index_map(op, layout, nt, stage.reverse))
    dt = lambda name: jnp.dtype(name)
    call = pl.pallas_call(
        kernel(body_name, **dict(params)),
        grid=stage.grid,
        in_specs=[spec(op) for op in stage.inputs],
        out_specs=[spec(op) for op in stage.outputs],
        out_shape=[jax.ShapeDtypeStruct(op.array_shape, dt(op.dtype)) for op in stage.outputs],
        scratch_shapes=[pltpu.VMEM(op.array_shape, dt(op.dtype)) for op in stage.scratch],
        compiler_params=pltpu.CompilerParams(dimension_semantics=stage.dimension_semantics),
        interpret=interpret,
        name=f"kda_{stage.name}",
    )
    return jax.jit(call)


def _row_to_col(x):
    """[1, N] -> [N, 1] without a transpose: an identity-masked lane reduction."""
    N = x.shape[1]
    return jnp.sum(jnp.where(iota((N, N), 0) == iota((N, N), 1), x, 0.0), axis=1, keepdims=True)


def _col_to_row(x):
    """[N, 1] -> [1, N]: an identity-masked sublane reduction."""
    N = x.shape[0]
    return jnp.sum(jnp.where(iota((N, N), 0) == iota((N, N), 1), x, 0.0), axis=0, keepdims=True)


def _segments(cr_ref):
    """Segment masks of one chunk from the chunk-local count of segment starts [1, C] (non-decreasing)."""
    cr = cr_ref[...]
    cc = _row_to_col(cr)
    same = cc == cr
    carry = jnp.where(cc == 0.0, 1.0, 0.0)
    in_last = cc == jnp.max(cr, axis=1, keepdims=True)
    return same, carry, in_last


def _gates(G, G_ref, carry, in_last, C):
    gam = carry * jnp.exp(G)
    E = jnp.where(in_last, jnp.exp(G_ref[C - 1 : C, :] - G), 0.0)
    return gam, E


def _row_reader(b_ref, G_ref):
    """(b[c], G[c]) as [1, K] for a traced row c: dynamic single-row loads from VMEM."""
    return lambda c: (b_ref[pl.ds(c, 1), :], G_ref[pl.ds(c, 1), :])


def fwd_prepare_kernel(q_ref, k_ref, v_ref, G_ref, beta_ref, cr_ref,
                       qg_ref, kg_ref, w_ref, u_ref, aqk_ref, ai_ref, b_ref, *, scale, cd, bounded):
    q, k, v = (r[...].astype(F32) for r in (q_ref, k_ref, v_ref))
    G, beta = G_ref[...], _row_to_col(beta_ref[...])
    C = q.shape[0]
    same, carry, in_last = _segments(cr_ref)
    gam, E = _gates(G, G_ref, carry, in_last, C)
    r, c = iota((C, C), 0), iota((C, C), 1)
    b_ref[...] = k
    rows = _row_reader(b_ref, G_ref)
    aqk = jnp.where(same & (r >= c), scale * decayed_scores(q, k, G, rows, cd, strict=False, bounded=bounded), 0.0)
    L = jnp.where(same & (r > c), beta * decayed_scores(k, k, G, rows, cd, strict=True, bounded=bounded), 0.0)
    ai = unit_lower_inverse(L)
    qg_ref[...] = (scale * q * gam).astype(qg_ref.dtype)
    kg_ref[...] = (k * E).astype(kg_ref.dtype)
    w_ref[...] = mm(ai, beta * k * gam, NN, cd).astype(w_ref.dtype)
    u_ref[...] = mm(ai, beta * v, NN, cd).astype(u_ref.dtype)
    aqk_ref[...] = aqk.astype(aqk_ref.dtype)
    ai_ref[...] = ai


def fwd_state_kernel(qg_ref, kg_ref, w_ref, u_ref, aqk_ref, decay_ref, h0_ref,
                     o_ref, vn_ref, hs_ref, ht_ref, s_ref, *, cd):
    n = pl.program_id(2)

    @pl.when(n == 0)
    def _():
        s_ref[...] = h0_ref[...]

    S = s_ref[...]
    hs_ref[...] = S
    vn = u_ref[...].astype(F32) - mm(w_ref[...], S, NN, cd)
    o = mm(qg_ref[...], S, NN, cd) + mm(aqk_ref[...], vn, NN, cd)
    o_ref[...] = o.astype(o_ref.dtype)
    vn_ref[...] = vn.astype(vn_ref.dtype)
    S = _row_to_col(decay_ref[...]) * S + mm(kg_ref[...], vn.astype(cd), TN, cd)
    s_ref[...] = S

    @pl.when(n == pl.num_programs(2) - 1)
    def _():
        ht_ref[...] = S


def bwd_state_kernel(qg_ref, kg_ref, w_ref, aqk_ref, decay_ref, do_ref, dht_ref,
                     dvn_ref, dh_ref, dh0_ref, ds_ref, *, cd):
    i = pl.program_id(2)  # chunk NT-1-i

    @pl.when(i == 0)
    def _():
        ds_ref[...] = dht_ref[...]

    dS = ds_ref[...]
    dh_ref[...] = dS
    do = do_ref[...]
    dvn = mm(aqk_ref[...], do, TN, cd) + mm(kg_ref[...], dS, NN, cd)
    dvn_ref[...] = dvn
    dS = _row_to_col(decay_ref[...]) * dS + mm(qg_ref[...], do, TN, cd) - mm(w_ref[...], dvn, TN, cd)
    ds_ref[...] = dS

    @pl.when(i == pl.num_programs(2) - 1)
    def _():
        dh0_ref[...] = dS


def bwd_chunk_kernel(q_ref, k_ref, v_ref, G_ref, beta_ref, cr_ref, ai_ref, hs_ref, dh_ref,
                     vn_ref, dvn_ref, do_ref,
                     dq_ref, dk_ref, dv_ref, dbeta_ref, dG_ref, ddecay_ref, b_ref, *, scale, cd, bounded):
    q, k, v = (r[...].astype(F32) for r in (q_ref, k_ref, v_ref))
    G, beta, ai = G_ref[...], _row_to_col(beta_ref[...]), ai_ref[...]
    S, dSn, vn, dvn, do = hs_ref[...], dh_ref[...], vn_ref[...], dvn_ref[...], do_ref[...]
    C = q.shape[0]
    same, carry, in_last = _segments(cr_ref)
    gam, E = _gates(G, G_ref, carry, in_last, C)
    r, c = iota((C, C), 0), iota((C, C), 1)
    kgam = k * gam
    rowsum = lambda x: jnp.sum(x, axis=1, keepdims=True)

    # Inter-chunk paths: qg = scale q Gam, kg = k E, decay (its gradient leaves through ddecay).
    dq = scale * mm(do, S, NT, cd) * gam
    dG = q * dq
    dk = E * mm(vn, dSn, NT, cd)
    t = k * dk
    dG = dG - t + jnp.where(iota((C, 1), 0) == C - 1, jnp.sum(t, axis=0, keepdims=True), 0.0)
    ddecay_ref[...] = _col_to_row(rowsum(S * dSn))

    # WY: u = Ai (beta v), w = Ai (beta k Gam), vn = u - w S.
    dW = -mm(dvn, S, NT, cd)
    dBv = mm(ai, dvn, TN, cd)
    dBk = mm(ai, dW, TN, cd)
    dv = beta * dBv
    dbeta = rowsum(dBv * v) + rowsum(dBk * kgam)
    dk = dk + beta * gam * dBk
    dG = dG + beta * kgam * dBk
    dAi = mm(dvn, beta * v, NT, cd) + mm(dW, beta * kgam, NT, cd)
    dAi_t = mm(beta * v, dvn, NT, cd) + mm(beta * kgam, dW, NT, cd)
    dL = jnp.where(same & (r > c), -mm(ai, mm(dAi, ai, NT), TN), 0.0)
    dL_t = jnp.where(same & (r < c), -mm(ai, mm(dAi_t, ai)), 0.0)

    # Intra-chunk scores: Aqk = scale (decayed q k^T), L = beta (decayed k k^T).
    dA = jnp.where(same & (r >= c), scale * mm(do, vn, NT, cd), 0.0)
    dA_t = jnp.where(same & (r <= c), scale * mm(vn, do, NT, cd), 0.0)
    rows = _row_reader(b_ref, G_ref)
    b_ref[...] = k
    dq_in = decayed_apply(dA, k, G, rows, cd, transposed=False, bounded=bounded)
    dkr = decayed_apply(dL, k, G, rows, cd, transposed=False, bounded=bounded)
    b_ref[...] = q
    dkc = decayed_apply(dA_t, q, G, rows, cd, transposed=True, bounded=bounded)
    b_ref[...] = beta * k
    dkc = dkc + decayed_apply(dL_t, beta * k, G, rows, cd, transposed=True, bounded=bounded)
    dq = dq + dq_in
    dk = dk + beta * dkr + dkc
    dbeta = dbeta + rowsum(k * dkr)
    dG = dG + q * dq_in + beta * k * dkr - k * dkc

    dq_ref[...] = dq.astype(dq_ref.dtype)
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)
    dbeta_ref[...] = _col_to_row(dbeta)
    dG_ref[...] = dG


KERNELS = {
    "fwd_prepare": fwd_prepare_kernel,
    "fwd_state": fwd_state_kernel,
    "bwd_state": bwd_state_kernel,
    "bwd_chunk": bwd_chunk_kernel,
}


def kernel(name: str, **params):
    if name not in KERNELS:
        raise ValueError(f"Unknown kernel {name!r}; expected one of {sorted(KERNELS)}")
    return functools.partial(KERNELS[name], **params)
