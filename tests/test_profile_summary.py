"""kimi_jax/profile_summary.py: kernel time of a traced step attributed to the model's named
scopes, by kind and by HLO op. benchmarks/train.py --profile_steps: tests/test_bench_train.py;
train.py --config.profile_steps: tests/test_train.py."""

import jax
import jax.numpy as jnp
import pytest

from kimi_jax import profile_summary as ps


def test_part_of_takes_the_outermost_known_scope():
    assert ps.part_of("jit(step)/transpose(jvp(mixer_kda))/ffn_mlp/dot_general") == "mixer_kda"
    assert ps.part_of("jit(step)/optimizer/mul") == "optimizer"
    assert ps.part_of("jit(step)/headless/mul") == "other"  # a prefix of a name is not the scope
    assert ps.part_of("") == "other"


def test_kernel_kinds():
    assert ps.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32", "custom-call.3") == "matmul"
    assert ps.kernel_kind("ncclDevKernel_AllReduce_Sum_f32", "all-reduce.1") == "collective"
    assert ps.kernel_kind("loop_add_fusion", "loop_add_fusion.2") == "fusion/other"
    assert ps.kernel_kind("mosaic_gpu_kernel", "custom-call.9") == "custom call"


def test_fusion_without_metadata_takes_its_ops_scope():
    hlo = "\n".join([
        "%fused_computation (p: f32[4]) -> f32[4] {",
        '  %p = f32[4]{0} parameter(0)',
        '  ROOT %sine.1 = f32[4]{0} sine(%p), metadata={op_name="jit(f)/mixer_mla/sin"}',
        "}",
        "ENTRY %main (a: f32[4]) -> f32[4] {",
        '  %a = f32[4]{0} parameter(0)',
        '  ROOT %fusion.7 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation',
        "}"])
    scopes = ps.op_scopes(hlo)
    assert scopes["fusion.7"] == "jit(f)/mixer_mla/sin" and scopes["sine.1"] == "jit(f)/mixer_mla/sin"


def test_entry_with_a_long_result_tuple_is_its_own_computation():
    """A computation header whose result tuple carries XLA's /*index=5*/ comments still starts a
    computation: its instructions are not taken for the previous (fused) computation's."""
    outs = ", ".join(["f32[4]"] * 5 + ["/*index=5*/f32[4]"])
    hlo = "\n".join([
        "%fused_computation (p: f32[4]) -> f32[4] {",
        '  ROOT %p = f32[4]{0} parameter(0)',
        "}",
        f"ENTRY %main (a: f32[4]) -> ({outs}) {{",
        '  %a = f32[4]{0} parameter(0)',
        '  %fusion.7 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation',
        f'  ROOT %t = ({outs}) tuple(%fusion.7, %fusion.7, %fusion.7, %fusion.7, %fusion.7, /*index=5*/%fusion.7)',
        "}"])
    comps = {name: comp for comp, name, _ in ps.hlo_instructions(hlo)}
    assert comps["p"] == "fused_computation"
    assert comps["a"] == comps["fusion.7"] == comps["t"] == "main"


def test_trace_is_attributed_to_named_scopes(tmp_path):
    def f(a, b):
        with jax.named_scope("ffn_mlp"):  # 4 large matmuls
            x = a
            for _ in range(4):
                x = jnp.tanh(x @ b)
        with jax.named_scope("mixer_kda"):  # one small elementwise op
            y = jnp.sin(x[:8]) * 3.0
        return y.sum()

    step = jax.jit(jax.grad(f))
    a = jnp.ones((384, 384), jnp.float32) / 384
    hlo = step.lower(a, a).compile().as_text()
    step(a, a).block_until_ready()
    jax.profiler.start_trace(str(tmp_path))
    for _ in range(2):
        step(a, a).block_until_ready()
    jax.profiler.stop_trace()
    s = ps.summarize(str(tmp_path), hlo, steps=2)
    assert s["kernel_ms_per_step"] > 0 and s["kernels_per_step"] >= 2
    assert abs(sum(s["by_part"].values()) - s["kernel_ms_per_step"]) < 0.01
    assert s["by_part"]["ffn_mlp"] > s["by_part"].get("mixer_kda", 0.0)
    assert {o["part"] for o in s["top_ops"]} >= {"ffn_mlp"}
    assert "| ffn_mlp |" in ps.markdown(s)


def test_missing_trace_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="xplane"):
        ps.summarize(str(tmp_path))


def test_graph_kernels_map_by_fusion_name_and_library_kernels_by_neighbour():
    scopes = {"loop_add_fusion.3": "jit(s)/ffn_mlp/add", "input_reduce_fusion": "jit(s)/mixer_kda/reduce_sum"}
    stream = [("nvjet_sm90_gemm", "command_buffer_1", 1.0),          # before any mapped kernel: takes the next
              ("input_reduce_fusion", "command_buffer_1", 1.0),
              ("sm90_xmma_gemm", "command_buffer_1", 1.0),           # after the KDA fusion
              ("loop_add_fusion_3", "command_buffer_1", 1.0)]        # "_3" is HLO's ".3"
    parts = [ps.part_of(n) for n in ps.kernel_scopes(stream, scopes)]
    assert parts == ["mixer_kda", "mixer_kda", "mixer_kda", "ffn_mlp"]



def test_scope_of_takes_the_innermost_named_scope_inside_a_part():
    names = ("proj", "conv", "recurrence", "kda_bwd")
    assert ps.scope_of("jit(f)/transpose(jvp(mixer_kda))/conv/mul", names) == "conv"
    assert ps.scope_of("jit(f)/mixer_kda/recurrence/proj_like/dot", names) == "recurrence"
    assert ps.scope_of("jit(f)/transpose(jvp(mixer_kda))/recurrence/kda_bwd/dot", names) == "kda_bwd"
    assert ps.scope_of("jit(f)/mixer_kda/projection/dot", names) == "-"  # whole tokens only


def test_write_profile_annotates_top_ops_with_their_source(tmp_path):
    """write_profile (train.py's --config.profile_steps, benchmarks/train.py --profile_steps):
    the top ops carry their bytes and the source lines of what they fuse."""
    def f(a, b):
        with jax.named_scope("ffn_mlp"):
            return jnp.sum(jnp.tanh(a @ b) * 2.0)

    step = jax.jit(jax.grad(f))
    a = jnp.ones((256, 256), jnp.float32) / 256
    hlo = step.lower(a, a).compile().as_text()
    step(a, a).block_until_ready()
    jax.profiler.start_trace(str(tmp_path))
    step(a, a).block_until_ready()
    jax.profiler.stop_trace()
    s = ps.write_profile(str(tmp_path), hlo, steps=1)
    described = [o for o in s["top_ops"] if o.get("bytes")]
    assert described, s["top_ops"]
    assert any("test_profile_summary.py" in src for o in described for src in o["source"])
    assert all(o["gbps"] is None or o["gbps"] > 0 for o in described)
    assert "| source |" in ps.markdown(s)
    assert (tmp_path / "summary.json").exists() and (tmp_path / "step.hlo.txt.gz").exists()
