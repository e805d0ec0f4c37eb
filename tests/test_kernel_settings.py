"""`config.kernel_settings`: one table of the traced implementation settings (KDA kernels, MoE
forms, backward forms), parsed with clear errors, put in place while train.py traces its steps and
restored afterwards; the benchmark rows read the same table."""

import pytest

from benchmarks.train_settings import parse_settings
from kernels.kda import chunk_segments
from kimi_jax import kernel_settings, layers, moe_dispatch
from tests.toy_lm import toy_config, use_toy_model


def test_parse_and_apply_restore():
    s = kernel_settings.parse("block_v=auto/segments=8/gate_up=fused_ffn/pair_sort=counting/norm_vjp=recompute")
    assert s == {"block_v": "auto", "segments": 8, "gate_up": "fused_ffn", "pair_sort": "counting",
                 "norm_vjp": "recompute"}
    assert kernel_settings.parse("") == {} and kernel_settings.parse(None) == {}
    before = (chunk_segments.BLOCK_V, chunk_segments.SEGMENTS, moe_dispatch.GATE_UP, moe_dispatch.PAIR_SORT,
              layers.NORM_VJP)
    with kernel_settings.applied(s):
        assert (chunk_segments.BLOCK_V, chunk_segments.SEGMENTS, moe_dispatch.GATE_UP, moe_dispatch.PAIR_SORT,
                layers.NORM_VJP) == ("auto", 8, "fused_ffn", "counting", "recompute")
    assert (chunk_segments.BLOCK_V, chunk_segments.SEGMENTS, moe_dispatch.GATE_UP, moe_dispatch.PAIR_SORT,
            layers.NORM_VJP) == before
    with pytest.raises(ValueError, match="key in"):
        kernel_settings.parse("blockv=16")
    with pytest.raises(ValueError, match="expected one of"):
        kernel_settings.parse("block_v=48")
    with pytest.raises(ValueError, match="key in"):
        kernel_settings.parse("mesh=fsdp")  # a benchmark row's key, not a config's
    assert parse_settings("mesh=fsdp/grad_issue=early") == {"mesh": "fsdp", "grad_issue": "early"}


def test_train_py_traces_with_the_settings_and_refuses_bad_ones(monkeypatch, tmp_path):
    import train

    use_toy_model(monkeypatch)
    seen = []  # the settings in place when the train step's loss is traced
    make = train.train_lib.make_loss_fn

    def make_loss_fn(*a, **kw):
        loss_fn = make(*a, **kw)

        def traced(*args, **kwargs):
            seen.append((chunk_segments.GRAD_ISSUE, moe_dispatch.PAIR_SORT))
            return loss_fn(*args, **kwargs)
        return traced

    monkeypatch.setattr(train.train_lib, "make_loss_fn", make_loss_fn)
    config = toy_config(**{"total_steps": 2, "kernel_settings": "grad_issue=early/pair_sort=counting"})
    train.train_and_evaluate(config, str(tmp_path / "run"))
    assert seen and set(seen) == {("early", "counting")}
    assert (chunk_segments.GRAD_ISSUE, moe_dispatch.PAIR_SORT) == ("in_order", "auto")
    with pytest.raises(ValueError, match="grad_issue='late'"):
        train.train_and_evaluate(toy_config(**{"kernel_settings": "grad_issue=late"}), str(tmp_path / "bad"))
    assert not (tmp_path / "bad").exists()
