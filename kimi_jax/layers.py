"""Basic layers shared by every mixer and block: Linear (DenseGeneral), RMSNorm, gated RMSNorm,
Embed, the causal short depthwise convolution with its decode cache, and RoPE.

Every parameter is made by `param`, which attaches logical axis names (see `kimi_jax.sharding`).
Compute dtype (`dtype`) and parameter dtype (`param_dtype`) are separate: parameters are stored
in `param_dtype` and cast to `dtype` at use; norms and RoPE compute in float32.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

Shape = Sequence[int]


def _mesh_active() -> bool:
    mesh = jax.sharding.get_abstract_mesh()
    return mesh is not None and not mesh.empty


def param(rngs: nnx.Rngs, init, shape: Shape, names: Sequence[str | None], param_dtype) -> nnx.Param:
    """An `nnx.Param` of `shape` carrying logical axis `names` (one per dimension).

    The value is sharded eagerly only when eager sharding is on (`nnx.use_eager_sharding`) and
    a mesh is active (then the logical rules of the context apply); otherwise (tests, abstract
    init, jitted init with `out_shardings`) the names are metadata only.
    """
    shape, names = tuple(int(s) for s in shape), tuple(names)
    if len(names) != len(shape):
        raise ValueError(f"param needs one logical name per dimension; got shape={shape}, names={names}")
    value = init(rngs.params(), shape, param_dtype)
    eager = nnx.using_eager_sharding() and _mesh_active()
    return nnx.Param(value, out_sharding=names, eager_sharding=eager)


def _as_tuple(x) -> tuple[int, ...]:
    return (int(x),) if isinstance(x, int) else tuple(int(v) for v in x)


class Linear(nnx.Module):
    """DenseGeneral: contracts the trailing `in_features` axes of x with a kernel
    [*in_features, *out_features]; `axes` names every kernel axis, in order."""

    def __init__(
        self,
        in_features: int | Shape,
        out_features: int | Shape,
        *,
        axes: Sequence[str | None],
        use_bias: bool = False,
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        kernel_init=None,
        rngs: nnx.Rngs,
    ):
        self.in_features, self.out_features = _as_tuple(in_features), _as_tuple(out_features)
        n_in, n_out = len(self.in_features), len(self.out_features)
        if len(axes) != n_in + n_out:
            raise ValueError(
                f"Linear axes must name {n_in}+{n_out} kernel axes; got axes={tuple(axes)} for "
                f"in_features={self.in_features}, out_features={self.out_features}"
            )
        if kernel_init is None:  # fan-in scaling over all contracted axes
            kernel_init = nnx.initializers.variance_scaling(
                1.0, "fan_in", "truncated_normal", in_axis=tuple(range(n_in)), out_axis=tuple(range(n_in, n_in + n_out))
            )
        self.dtype = dtype
        self.kernel = param(rngs, kernel_init, self.in_features + self.out_features, axes, param_dtype)
        self.bias = (
            param(rngs, nnx.initializers.zeros, self.out_features, tuple(axes)[n_in:], param_dtype) if use_bias else None
        )

    def __call__(self, x):
        """x [..., *in_features] -> [..., *out_features] in the compute dtype."""
        n_in = len(self.in_features)
        if tuple(x.shape[x.ndim - n_in :]) != self.in_features:
            raise ValueError(f"Linear expects x [..., {self.in_features}]; got x.shape={x.shape}")
        y = jnp.tensordot(x.astype(self.dtype), self.kernel[...].astype(self.dtype), axes=n_in)
        if self.bias is not None:
            y = y + self.bias[...].astype(self.dtype)
        return y


def rms_normalize(x, eps: float):
    """x / sqrt(mean(x^2) + eps) over the last axis, in float32."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


# How the norms (RMSNorm, the gated output norm, the q/k l2 norm) are differentiated (read while
# tracing; `norm_vjp(mode)` sets it for a block): "autodiff" (JAX's linearization keeps float32
# copies of x, and for the gated norm of the normalised output and the sigmoid too) or
# "recompute" (a custom VJP keeping x and the gate in their own dtype and the float32 [.., 1]
# inverse norm). The 1.3B train step on an H200: 406.3 ms against 409.4 with "autodiff", the same
# temporaries (benchmarks/results/train-vjp-*-h200x2-20261130T2217.json; within the spread).
NORM_VJP = "autodiff"
NORM_VJP_MODES = ("autodiff", "recompute")


def norm_vjp(mode: str | None):
    """Within the block, trace RMSNorm, GatedRMSNorm and l2_normalize with backward `mode`
    (None: unchanged)."""
    return traced_setting(sys.modules[__name__], "NORM_VJP", NORM_VJP_MODES, mode)


def _rms_norm(x, w, gate, eps: float):
    """(rms_normalize(x) * w [* sigmoid(gate)] in float32, the inverse RMS [.., 1])."""
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    y = xf * r * w.astype(jnp.float32)
    return (y if gate is None else y * jax.nn.sigmoid(gate.astype(jnp.float32))), r


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _rms_norm_recompute(x, w, gate, eps):
    return _rms_norm(x, w, gate, eps)[0]


def _rms_norm_fwd(x, w, gate, eps):
    y, r = _rms_norm(x, w, gate, eps)
    return y, (x, w, gate, r)


def _rms_norm_bwd(eps, res, ct):
    x, w, gate, r = res
    n = x.astype(jnp.float32) * r  # the normalised x
    s = None if gate is None else jax.nn.sigmoid(gate.astype(jnp.float32))
    cs = ct if s is None else ct * s
    wf = w.astype(jnp.float32)
    dn = cs * wf
    dx = r * (dn - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    dw = jnp.sum((cs * n).reshape(-1, n.shape[-1]), axis=0)
    dgate = None if s is None else (ct * n * wf * s * (1 - s)).astype(gate.dtype)
    return dx.astype(x.dtype), dw.astype(w.dtype), dgate


_rms_norm_recompute.defvjp(_rms_norm_fwd, _rms_norm_bwd)


def rms_norm(x, w, gate=None, *, eps: float):
    """rms_normalize(x) * w [* sigmoid(gate)] in float32, differentiated as NORM_VJP says.
    x [..., D]; w [D]; gate None or x's shape."""
    if read_setting(sys.modules[__name__], "NORM_VJP", NORM_VJP_MODES) == "recompute":
        return _rms_norm_recompute(x, w, gate, float(eps))
    return _rms_norm(x, w, gate, eps)[0]


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis with a learned scale (init 1); computes in float32."""

    def __init__(self, dim: int, *, eps: float = 1e-5, dtype=jnp.float32, param_dtype=jnp.float32, rngs: nnx.Rngs):
        self.dim, self.eps, self.dtype = int(dim), float(eps), dtype
        self.scale = param(rngs, nnx.initializers.ones, (self.dim,), ("norm",), param_dtype)

    def __call__(self, x):
        if x.shape[-1] != self.dim:
            raise ValueError(f"RMSNorm({self.dim}) got x.shape={x.shape}")
        return rms_norm(x, self.scale[...], eps=self.eps).astype(self.dtype)


class GatedRMSNorm(RMSNorm):
    """Per-head output norm of the recurrent mixers: RMSNorm(o) * w * sigmoid(gate), with one
    weight [V] shared by all heads (fla's FusedRMSNormGated with activation="sigmoid")."""

    def __call__(self, x, gate=None):
        """x [..., V]; gate None or [..., V] (raw, before the sigmoid)."""
        if x.shape[-1] != self.dim:
            raise ValueError(f"GatedRMSNorm({self.dim}) got x.shape={x.shape}")
        if gate is not None and gate.shape != x.shape:
            raise ValueError(f"gate must match x: gate.shape={gate.shape}, x.shape={x.shape}")
        return rms_norm(x, self.scale[...], gate, eps=self.eps).astype(self.dtype)


class Embed(nnx.Module):
    """Token (or learned position) embedding [vocab, embed]; `attend` gives tied logits."""

    def __init__(self, vocab_size: int, dim: int, *, axes=("vocab", "embed"), dtype=jnp.float32,
                 param_dtype=jnp.float32, init_std: float = 1.0, rngs: nnx.Rngs):
        self.vocab_size, self.dim, self.dtype = int(vocab_size), int(dim), dtype
        self.embedding = param(rngs, nnx.initializers.normal(init_std), (self.vocab_size, self.dim), axes,
                               param_dtype)

    def __call__(self, tokens):
        """tokens [...] int -> [..., D] in the compute dtype."""
        if not jnp.issubdtype(tokens.dtype, jnp.integer):
            raise ValueError(f"Embed expects integer tokens; got dtype {tokens.dtype}")
        return jnp.take(self.embedding[...], tokens, axis=0).astype(self.dtype)

    def attend(self, x):
        """x [..., D] -> logits [..., vocab] in float32."""
        return jnp.einsum("...d,vd->...v", x.astype(self.dtype), self.embedding[...].astype(self.dtype)).astype(
            jnp.float32
        )


class ShortConv(nnx.Module):
    """Causal depthwise convolution of width W over time, then SiLU (fla ShortConvolution).

    Weight [W, *channels]; the last tap multiplies the current token. Packed documents do not
    see each other: taps reaching into an earlier segment read zero. The decode cache holds the
    previous W-1 pre-activation inputs [B, W-1, *channels].
    """

    def __init__(
        self,
        channels: int | Shape,
        *,
        kernel_size: int = 4,
        axes: Sequence[str | None],
        dtype=jnp.float32,
        param_dtype=jnp.float32,
        rngs: nnx.Rngs,
    ):
        self.channels = _as_tuple(channels)
        if kernel_size < 1:
            raise ValueError(f"ShortConv kernel_size must be >= 1; got {kernel_size}")
        self.kernel_size, self.dtype = int(kernel_size), dtype
        bound = kernel_size**-0.5  # PyTorch Conv1d default for a depthwise filter (fan_in = W)
        init = lambda key, shape, dt: jax.random.uniform(key, shape, dt, -bound, bound)
        self.weight = param(rngs, init, (self.kernel_size,) + self.channels, ("conv",) + tuple(axes), param_dtype)

    def __call__(self, x, segment_ids=None):
        """x [B, T, *channels] -> SiLU(conv(x)) of the same shape."""
        if tuple(x.shape[2:]) != self.channels:
            raise ValueError(f"ShortConv expects x [B, T, {self.channels}]; got x.shape={x.shape}")
        if segment_ids is not None and segment_ids.shape != x.shape[:2]:
            raise ValueError(f"segment_ids must be [B, T] = {x.shape[:2]}; got {segment_ids.shape}")
        return causal_conv_silu(x.astype(self.dtype), self.weight[...].astype(self.dtype), segment_ids)

    def init_cache(self, batch_size: int, dtype):
        return jnp.zeros((batch_size, self.kernel_size - 1) + self.channels, dtype)

    def step(self, x, cache):
        """x [B, *channels] (one token), cache [B, W-1, *channels] -> (y [B, *channels], cache)."""
        if tuple(x.shape[1:]) != self.channels or cache.shape[0] != x.shape[0]:
            raise ValueError(f"ShortConv.step: x.shape={x.shape}, cache.shape={cache.shape}, channels={self.channels}")
        window = jnp.concatenate([cache.astype(self.dtype), x.astype(self.dtype)[:, None]], axis=1)  # [B, W, ...]
        w = self.weight[...].astype(self.dtype)
        y = jnp.einsum("bw...,w...->b...", window, w, preferred_element_type=jnp.float32)
        return jax.nn.silu(y).astype(self.dtype), window[:, 1:].astype(cache.dtype)


def _shift(x, s: int):
    """x [B, T, ...] delayed by s >= 0 steps along T (zeros enter), or advanced by -s if s < 0:
    one pad op with a negative edge, which XLA fuses into its consumer (no padded copy)."""
    if s == 0:
        return x
    cfg = [(0, 0, 0), (s, -s, 0)] + [(0, 0, 0)] * (x.ndim - 2)
    return jax.lax.pad(x, jnp.zeros((), x.dtype), cfg)


def _tap_masks(segment_ids, W: int, ndim: int):
    """Per tap i (reading s = W-1-i steps back), [B, T, 1...] bool: the source token is in the
    same packed segment (None without segment_ids: the zero fill of `_shift` suffices)."""
    if segment_ids is None:
        return [None] * W
    B, T = segment_ids.shape
    out = []
    for i in range(W):
        s = W - 1 - i
        same = _shift(segment_ids, s) == segment_ids  # t < s: x reads zero there anyway
        out.append(None if s == 0 else same.reshape((B, T) + (1,) * (ndim - 2)))
    return out


def _conv_pre(x, w, masks):
    """Pre-activation sum_i w[i] * x[t - (W-1-i)] (masked) in float32."""
    W = w.shape[0]
    wf = w.astype(jnp.float32)
    a = None
    for i in range(W):
        tap = _shift(x, W - 1 - i).astype(jnp.float32)
        if masks[i] is not None:
            tap = jnp.where(masks[i], tap, 0.0)
        a = tap * wf[i] if a is None else a + tap * wf[i]
    return a


# How the backward sums the tap gradients over B, T (read while the backward is traced).
# "stacked": one reduction of the stacked [W, B, T, ...] products, a fusion of its own.
# "per_tap": one reduction per tap, which XLA can fuse into the fusions that produce dy. On an
# H200 the KDA layer of configs/k3_1b3_dense.py alone at 4 x 4096 (forward+backward) took 11.11 ms
# of kernels with "stacked" and 10.54 with "per_tap" (`benchmarks/kda_profile.py --mixer`), but
# the whole train step 406.1 against 412.2 ms (`benchmarks/train.py --rows 1:none:4[:conv_dw=...]`,
# results train-convdw-*-h200-20261130T175*.json): not adopted. Why "stacked" is
# slow (16% of HBM bandwidth): in the fused body the "stacked" profile's JSON holds, XLA reduces
# one row per (channel, tap), so each tap reads the pre-activation gradient and x again.
# "variadic" sums the W taps as one variadic reduction (W accumulators in one pass over the
# inputs): the layer 10.97 against 11.17 ms, the step 409.3 against 406.3 / 408.5
# (kda-mixer-profile-screen-*, train-xlaopt-*-h200x2-20261130T1950.json): not adopted either.
# "pallas_gpu": the tap sums by the Mosaic GPU kernel of `kernels.short_conv` (W float32
# accumulators in registers per program), dx by XLA; calls it cannot take (T not a multiple of
# 128, ...) use "stacked" and say so once in the log. On CPU it runs interpreted. On an H200
# (short-conv-h200-20261201T0129.json, 4 x 4096 x 2048 bf16) the kernel takes 0.16-0.18 ms
# against 0.42 ms for the whole stacked VJP, but the VJP with it is no faster (XLA's dx fusion then
# runs alone); in the step 400.9 against 404.2 ms (train-convdw-*-h200-20261201T0129.json).
# "pallas_gpu_da": da = dy * silu'(a) written once by XLA (an optimization barrier keeps the dx
# fusion from recomputing it at each tap's offset), dx from da, the kernel reading da.
# "auto" (default): "pallas_gpu_da" on a Hopper GPU, "stacked" on every other device. With the
# attention-residual reads' outputs saved (`attn_res.READ_OUT`, the default), the 1.3B step took
# 386.0 and 393.9 ms in two calls against 406.3 and 410.1 for "stacked" with XLA's reads, while
# either change alone gave 405.5 / 405.9 ms (train-convdwda-saved-*-h200-20261201T03*.json,
# train-default-h200-20261201T0304.json).
CONV_DW_MODES = ("auto", "stacked", "per_tap", "variadic", "pallas_gpu", "pallas_gpu_da")
_KERNEL_MODES = ("pallas_gpu", "pallas_gpu_da")
CONV_DW = "auto"


@contextlib.contextmanager
def traced_setting(module, name: str, choices, value):
    """Within the block, `module.<name>` is `value` (None: unchanged), restored afterwards; for
    module settings read while tracing. A value outside `choices` raises."""
    if value is not None and value not in choices:
        raise ValueError(f"{module.__name__}.{name}={value!r}; expected one of {choices}")
    old = getattr(module, name)
    setattr(module, name, old if value is None else value)
    try:
        yield
    finally:
        setattr(module, name, old)


def read_setting(module, name: str, choices):
    """`module.<name>`, a module setting read while tracing; a value outside `choices` raises."""
    value = getattr(module, name)
    if value not in choices:
        raise ValueError(f"{module.__name__}.{name}={value!r}; expected one of {choices}")
    return value


def conv_dw(mode: str | None):
    """Within the block, trace the short conv's backward with tap sums `mode` (None: unchanged)."""
    return traced_setting(sys.modules[__name__], "CONV_DW", CONV_DW_MODES, mode)


@jax.custom_vjp
def causal_conv_silu(x, w, segment_ids=None):
    """SiLU of the causal depthwise conv: x [B, T, *C], w [W, *C] -> [B, T, *C] in x's dtype.

    Taps accumulate in float32; taps reaching before the start or into an earlier segment
    read zero. The custom VJP recomputes the pre-activation from x and returns dx and all W
    tap gradients from (dy, x) without autodiff's per-tap padded copies (the tap sums: see
    CONV_DW); dx accumulates its W taps in float32 before the one cast.
    """
    a = _conv_pre(x, w, _tap_masks(segment_ids, w.shape[0], x.ndim))
    return jax.nn.silu(a).astype(x.dtype)


def _ccs_fwd(x, w, segment_ids=None):
    return causal_conv_silu(x, w, segment_ids), (x, w, segment_ids)


def _ccs_bwd(res, dy):
    x, w, segment_ids = res
    W = w.shape[0]
    mode = read_setting(sys.modules[__name__], "CONV_DW", CONV_DW_MODES)
    if mode == "auto":
        from kernels.kda.hopper import device_kind

        mode = "pallas_gpu_da" if device_kind() == "hopper" else "stacked"
    if mode in _KERNEL_MODES:
        from kernels.short_conv import ops as conv_ops

        mode = "stacked" if conv_ops.fallback_reason(x, W) else mode
    masks = _tap_masks(segment_ids, W, x.ndim)
    a = _conv_pre(x, w, masks)
    sig = jax.nn.sigmoid(a)
    da = dy.astype(jnp.float32) * (sig * (1.0 + a * (1.0 - sig)))  # d silu(a) / da
    if mode == "pallas_gpu_da":
        da = jax.lax.optimization_barrier(da)
    wf = w.astype(jnp.float32)
    dx, prods = None, []
    for i in range(W):
        s = W - 1 - i
        dai = da if masks[i] is None else jnp.where(masks[i], da, 0.0)
        if mode not in _KERNEL_MODES:
            prods.append(dai * _shift(x, s).astype(jnp.float32))
        c = _shift(dai, -s) * wf[i]  # dx[t] += w[i] * da[t + s] (masked at t + s)
        dx = c if dx is None else dx + c
    if mode == "pallas_gpu":  # the kernel recomputes da from x and dy
        dw = conv_ops.tap_grads(x, dy, w, segment_ids)
    elif mode == "pallas_gpu_da":
        dw = conv_ops.tap_grads(x, da, w, segment_ids, from_da=True)
    elif mode == "per_tap":  # W sibling reductions over B, T
        dw = jnp.stack([jnp.sum(p, axis=(0, 1)) for p in prods])
    elif mode == "variadic":  # one reduction over B, T with W accumulators
        zeros = tuple(jnp.zeros((), jnp.float32) for _ in prods)
        dw = jnp.stack(jax.lax.reduce(tuple(prods), zeros, lambda a, b: tuple(x + y for x, y in zip(a, b)), (0, 1)))
    else:  # one reduction of the stacked [W, B, T, ...] products
        dw = jnp.sum(jnp.stack(prods), axis=(1, 2))
    return dx.astype(x.dtype), dw.astype(w.dtype), None


causal_conv_silu.defvjp(_ccs_fwd, _ccs_bwd)


def dropout(x, rate: float, key):
    """Inverted dropout: each element zeroed with probability `rate`, the others scaled by
    1 / (1 - rate) so the expectation is x; x itself where `key` is None (evaluation) or rate is 0."""
    if key is None or rate == 0:
        return x
    keep = jax.random.bernoulli(key, 1.0 - rate, x.shape)
    return jnp.where(keep, x / (1.0 - rate), 0).astype(x.dtype)


def segment_positions(segment_ids, T: int, batch_size: int):
    """[B, T] int32 positions that restart at 0 where a new packed document begins."""
    idx = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (batch_size, T))
    if segment_ids is None:
        return idx
    starts = jnp.concatenate(
        [jnp.ones((batch_size, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1
    )
    return idx - jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)


def apply_rope(x, positions, theta: float):
    """Rotary embedding (rotate-half form) on x [B, T, H, D] at positions [B, T]; D even."""
    D = x.shape[-1]
    if D % 2:
        raise ValueError(f"RoPE needs an even head dim; got x.shape={x.shape}")
    if positions.shape != x.shape[:2]:
        raise ValueError(f"positions must be [B, T] = {x.shape[:2]}; got {positions.shape}")
    inv_freq = 1.0 / (theta ** (jnp.arange(0, D, 2, dtype=jnp.float32) / D))  # [D/2]
    ang = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, D/2]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _l2(x, eps):
    xf = x.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.sum(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * r).astype(x.dtype), r


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _l2_recompute(x, eps):
    return _l2(x, eps)[0]


def _l2_fwd(x, eps):
    y, r = _l2(x, eps)
    return y, (x, r)


def _l2_bwd(eps, res, dy):
    x, r = res
    y, dy = x.astype(jnp.float32) * r, dy.astype(jnp.float32)  # dx = r (dy - y <y, dy>)
    return ((r * (dy - y * jnp.sum(y * dy, axis=-1, keepdims=True))).astype(x.dtype),)


_l2_recompute.defvjp(_l2_fwd, _l2_bwd)


def l2_normalize(x, eps: float = 1e-6):
    """x * rsqrt(sum(x^2) + eps) over the last axis (fla's qk l2norm), computed in float32;
    differentiated as NORM_VJP says."""
    if read_setting(sys.modules[__name__], "NORM_VJP", NORM_VJP_MODES) == "recompute":
        return _l2_recompute(x, float(eps))
    return _l2(x, eps)[0]
