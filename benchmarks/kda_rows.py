"""The rows of `benchmarks/kda.py`'s results: the work model each row's TFLOP/s and GB/s count
(the chunked algorithm's FLOPs and each call's inputs and outputs read or written once; causal
attention's for cuDNN) and the markdown table, with percentages of the H200's peaks."""

from __future__ import annotations

from benchmarks.common import PEAK_TBPS, PEAK_TFLOPS, fmt, markdown_table, roofline

CHUNK = 64


def kda_model(B, T, H, K, V):
    """(forward FLOPs, forward+backward FLOPs, forward bytes, forward+backward bytes)."""
    n = B * T * H
    f = n * (6 * CHUNK * K + 4 * CHUNK * V + 6 * K * V)
    inputs = n * (2 * (2 * K + V) + 4 * K + 4)
    fwd_bytes = inputs + n * 2 * V
    return f, 3 * f, fwd_bytes, fwd_bytes + inputs + n * 2 * V + inputs


def attention_model(B, T, H, D):
    f = 2 * B * H * T * T * D
    b = B * T * H * D * 2
    return f, 3.5 * f, 4 * b, 12 * b


def ratio(a, b):
    return None if a is None or b is None else a / b


def table_row(name, kind, shape, res, err):
    """A table row: times, the model's TFLOP/s and GB/s for them, and the model's counts."""
    B, T, H, D = shape
    model = attention_model(B, T, H, D) if name.startswith("cudnn") else kda_model(B, T, H, D, D)
    fwd_ms, fb_ms = (None, None) if res is None else (res[0], res[1])
    tf_f, gb_f = roofline(fwd_ms, model[0], model[2])
    tf_b, gb_b = roofline(fb_ms, model[1], model[3])
    return dict(
        name=name, kind=kind, shape=list(shape), fwd_ms=fwd_ms, fwd_bwd_ms=fb_ms, error=err,
        fwd_tflops=tf_f, fwd_gbps=gb_f, fwd_bwd_tflops=tf_b, fwd_bwd_gbps=gb_b,
        flops=dict(fwd=model[0], fwd_bwd=model[1]), bytes=dict(fwd=model[2], fwd_bwd=model[3]),
    )  # fmt: skip


def table(rows) -> str:
    peers = sorted({p for r in rows for p in r.get("ratios", {})})
    header = ["B,T,H,D", "impl", "ms fwd", "ms fwd+bwd", "TFLOP/s f+b", "GB/s f+b", "% peak f+b"]
    header += [f"x {p} (fwd / f+b)" for p in peers] + ["o err vs chunk", "note"]
    out = []
    for r in rows:
        pk = None
        if r["fwd_bwd_tflops"] is not None:
            pk = 100 * max(r["fwd_bwd_tflops"] / PEAK_TFLOPS, r["fwd_bwd_gbps"] / (1e3 * PEAK_TBPS))
        cells = [",".join(map(str, r["shape"])), r["name"], fmt(r["fwd_ms"]), fmt(r["fwd_bwd_ms"])]
        cells += [fmt(r["fwd_bwd_tflops"], 1), fmt(r["fwd_bwd_gbps"], 0), fmt(pk, 1)]
        for p in peers:
            rr = r.get("ratios", {}).get(p)
            cells.append("–" if rr is None else f"{fmt(rr['fwd'])} / {fmt(rr['fwd_bwd'])}")
        err = r.get("o_rel_err_vs_chunk")
        cells += [fmt(err, 4) if err is not None else "–", (r["error"] or "").replace("|", "/")]
        out.append(cells)
    return markdown_table(header, out)
