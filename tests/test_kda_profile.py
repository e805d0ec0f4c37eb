"""benchmarks/kda_profile.py and the HLO facts `kimi_jax.profile_summary` attaches to a profiled
fusion (source lines from the module's stack-frame tables, bytes moved, the fused body)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import kda_profile as kp
from kimi_jax import profile_summary as ps


def _inner(x):
    return jnp.sin(x) * 3


def _middle(x):
    return _inner(jnp.cos(x))


def _outer(x):
    return _middle(x) + 1


def test_stack_frames_and_fusion_description():
    hlo = jax.jit(_outer).lower(jnp.ones((4, 8), jnp.float32)).compile().as_text()
    frames = ps.stack_frames(hlo)
    line = lambda f: f"test_kda_profile.py:{f.__code__.co_firstlineno + 1}"
    # The sine's stack, innermost first: _inner's line, then its callers' call sites.
    assert [line(_inner), line(_middle), line(_outer)] in [c[:3] for c in frames.values()]
    instrs, comps = ps.instructions(hlo)
    fusion = next(n for n, text in instrs.items() if " fusion(" in text and "calls=" in text)
    d = ps.describe(fusion, instrs, comps, frames, body_lines=50)
    assert d["bytes"] == 2 * 4 * 8 * 4  # one f32[4,8] operand, one f32[4,8] result
    assert any("sine(" in b for b in d["body"]) and any("cosine(" in b for b in d["body"])
    assert any(src.startswith(f"{line(_inner)} < {line(_middle)}") for src in d["source"]), d["source"]
    assert ps.describe("no_such_op", instrs, comps, frames, 5) is None


def test_array_bytes():
    assert ps.array_bytes("(bf16[2,3]{1,0}, f32[4]{0}) pred[]") == 2 * 3 * 2 + 4 * 4 + 1


def test_kda_call_traces_under_the_named_chunk_settings():
    """"chunk:cumsum=scan" profiles the gate cumsum as XLA's scan (a reduce-window), the default
    "chunk" as the triangular matmul: the settings hold while the call is traced."""
    texts = {}
    for impl in ("chunk:cumsum=scan", "chunk"):
        fn, args = kp.kda_call(impl, (1, 64, 1, 16))
        texts[impl] = jax.jit(fn).lower(*args).as_text()
    assert "reduce_window" in texts["chunk:cumsum=scan"] and "reduce_window" not in texts["chunk"]
    # a backward-only setting holds while the backward rule is traced too: the compiled WY kernel
    # is refused on a CPU backend, which only a backward traced under the setting can notice
    if jax.default_backend() == "cpu":
        fn, args = kp.kda_call("chunk:wy_bwd=mosaic", (1, 64, 1, 16))
        with pytest.raises(ValueError, match="interpret"):
            jax.jit(fn).lower(*args)


def test_mixer_profile_sums_kernels_by_the_mixers_scopes(tmp_path):
    """--mixer: the KDA layer's forward+backward, its kernels' time under the mixer part and split
    over its named scopes (the op's backward rule apart from its forward)."""
    fn, args = kp.mixer_call("configs/tiny.py", "chunk", (1, 64))
    r = kp.profile_call("mixer", fn, args, calls=1, top=5, body_lines=2, folder=str(tmp_path),
                        scopes=kp.MIXER_SCOPES)
    s = r["summary"]
    assert abs(sum(s["by_scope"].values()) - s["kernel_ms_per_step"]) < 0.01
    scopes = {k.split(" / ")[1] for k in s["by_scope"]}
    assert {"recurrence", "kda_bwd", "proj", "conv"} <= scopes, s["by_scope"]
    in_mixer = sum(v for k, v in s["by_scope"].items() if k.startswith("mixer_kda /"))
    # All but the test's loss sum, whose few small ops took up to a quarter of the time on a CPU
    # loaded by the parallel test run (measured once: 2.3 of 8.4 ms); misattributed scopes give ~0.
    assert in_mixer > 0.5 * s["kernel_ms_per_step"], s["by_scope"]
    assert all("scope" in o for o in s["top_ops"])


def test_mixer_shape_is_b_by_t():
    assert kp._parse_mixer_shape("4x4096") == (4, 4096)
    with pytest.raises(ValueError, match="BxT"):
        kp._parse_mixer_shape("4x4096x16x128")


def test_mixer_call_traces_under_row_settings():
    """--settings: the layer is traced with benchmarks/train.py's row settings in place (the layout
    constraints appear in the program) and computes the same gradients."""
    plain_fn, args = kp.mixer_call("configs/tiny.py", "chunk", (1, 64))
    fn, _ = kp.mixer_call("configs/tiny.py", "chunk", (1, 64), "conv_dw=variadic/layout=row_major")
    assert "LayoutConstraint" in jax.jit(fn).lower(*args).as_text()
    assert "LayoutConstraint" not in jax.jit(plain_fn).lower(*args).as_text()
    for a, b in zip(jax.tree.leaves(jax.jit(fn)(*args)), jax.tree.leaves(jax.jit(plain_fn)(*args))):
        np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=2e-2, atol=2e-3)
    with pytest.raises(ValueError, match="layout"):
        kp.mixer_call("configs/tiny.py", "chunk", (1, 64), "layout=column_major")


def test_mixer_quick_command_writes_the_scopes(tmp_path):
    out = tmp_path / "mixer.json"
    (result,) = kp.main(["--mixer", "configs/tiny.py", "--quick", "--calls", "1", "--top", "3",
                         "--settings", "conv_dw=variadic", "--out", str(out)])
    assert result["shape"] == [1, 128] and "conv_dw=variadic" in result["impl"]
    assert json.loads(out.read_text())["results"][0]["summary"]["by_scope"]
    with pytest.raises(ValueError, match="--mixer"):
        kp.main(["--settings", "layout=row_major", "--quick"])


def test_forward_step_profiles_the_undifferentiated_call(tmp_path):
    """--step fwd: the profiled program is kda's forward alone (no gradient operands, o out), the
    default step returns o with the four gradients; the step is refused where it has no meaning."""
    fwd, args = kp.kda_call("chunk", (1, 64, 1, 16), step="fwd")
    both, _ = kp.kda_call("chunk", (1, 64, 1, 16))
    o = jax.jit(fwd)(*args)
    o2, grads = jax.jit(both)(*args)
    assert o.shape == (1, 64, 1, 16) and len(grads) == 5
    np.testing.assert_array_equal(np.asarray(o, np.float32), np.asarray(o2, np.float32))
    assert len(jax.jit(fwd).lower(*args).compile().as_text()) < len(jax.jit(both).lower(*args).compile().as_text())
    out = tmp_path / "fwd.json"
    (result,) = kp.main(["--quick", "--step", "fwd", "--calls", "1", "--top", "3", "--out", str(out)])
    assert result["impl"] == "chunk forward" and result["summary"]["kernel_ms_per_step"] > 0
    with pytest.raises(ValueError, match="step"):
        kp.kda_call("chunk", (1, 64, 1, 16), step="bwd")
    with pytest.raises(ValueError, match="--step fwd"):
        kp.main(["--quick", "--step", "fwd", "--decode"])
