"""`hi_lr` extends the MQAR gpu grids' lr axis with Zoology's top lr 1e-2 without touching the
plain grid's trials, so it can run in a finished `:gpu_small` workdir and add only the new lr."""

from __future__ import annotations

import pytest

import sweep as sw
from configs.sweeps import mqar


def _trials(variant: str):
    return sw.make_trials(mqar.get_config(variant), "/nonexistent")


@pytest.mark.parametrize("variant,count", [("gpu_small", 6 * 2 * 3), ("gpu", 6 * 2 * 2 * 3),
                                           ("cpu", 6 * 3)])
def test_hi_lr_adds_1e2_and_keeps_the_plain_trials(variant, count):
    plain, wide = _trials(variant), _trials(f"{variant},hi_lr")
    assert len(wide) == count
    assert sorted({t.point["lr"] for t in wide}) == [1e-3, 3e-3, 1e-2]
    by_name = {t.name: t for t in wide}
    for t in plain:  # same name and trial config: a finished trial is skipped, not retrained
        assert t.name in by_name and by_name[t.name].config == t.config
    new = [t for t in wide if t.name not in {p.name for p in plain}]
    assert len(new) == count // 3 and all(t.point["lr"] == 1e-2 for t in new)


def test_hi_lr_trial_is_the_plain_trial_at_lr_1e2():
    """The lr is the only difference: it is an override of the trial, not part of its config."""
    t = next(t for t in _trials("gpu_small,hi_lr") if t.point["lr"] == 1e-2)
    assert ("optim.lr", "{lr}") in [tuple(o) for o in mqar.get_config("gpu_small,hi_lr").overrides]
    config = mqar.get_config(t.config.split(":", 1)[1])
    assert config.total_steps == 4000 and config.optim.warmup_steps == 200


def test_full_grid_already_has_1e2():
    assert mqar.get_config("hi_lr").axes.lr == mqar.get_config(None).axes.lr


def test_softmax_forms_grid():
    """16 softmax trials at (256, 16): RoPE x MLP x budget x lr; each trial config is the
    ablation model with NoPE / no FFN as named and the named step count."""
    trials = _trials("softmax_forms")
    assert len(trials) == 16 and len({t.name for t in trials}) == 16
    seen = set()
    for t in trials:
        p = t.point
        config = mqar.get_config(t.config.split(":", 1)[1])
        assert config.model.mixer_pattern == ("softmax",) and config.model.d_model == 64
        assert config.data.task_kwargs.seq_len == 256 and config.data.task_kwargs.num_kv_pairs == 16
        assert (config.model.mixers.softmax.rope_theta is not None) == p["rope"]
        assert config.model.ffn == p["mlp"] and config.total_steps == p["steps"]
        seen.add((p["rope"], p["mlp"], p["steps"], p["lr"]))
    assert len(seen) == 16


def test_widths_restricts_the_grid_and_keeps_trial_names():
    full = {t.name: t for t in _trials("gpu")}
    only = _trials("gpu,widths=128")
    assert len(only) == 24 and {t.point["d_model"] for t in only} == {128}
    assert all(t.name in full and full[t.name].config == t.config for t in only)
    assert len(_trials("gpu,widths=64+128")) == 48
    with pytest.raises(ValueError, match="256.* not in this variant's d_model axis"):
        mqar.get_config("gpu,widths=256")


def test_gpu_long_grid():
    """Every mixer x d_model {64, 128, 256} x the four settings, lr 3e-3, 12000 steps (the
    softmax_forms budget); widths= and settings= pick pieces with the full grid's trial names."""
    full = {t.name: t for t in _trials("gpu_long")}
    assert len(full) == 6 * 3 * 4
    wide = _trials("gpu_long,widths=256,settings=64x4")
    assert len(wide) == 6 and all(t.name in full for t in wide)
    assert all(mqar.get_config(t.config.split(":", 1)[1]).model.d_model == 256 for t in wide)
    piece = _trials("gpu_long,widths=64,settings=256x16")
    assert len(piece) == 6 and {t.point["mixer"] for t in piece} == set(mqar.ABLATION_MIXERS)
    for t in piece:
        assert t.name in full and full[t.name].config == t.config
        config = mqar.get_config(t.config.split(":", 1)[1])
        assert config.total_steps == 12000 and config.data.batch_size == 128 and config.model.d_model == 64
        assert (config.data.task_kwargs.seq_len, config.data.task_kwargs.num_kv_pairs) == (256, 16)
        assert t.point["lr"] == 3e-3
    hard = _trials("gpu_long,settings=512x64+64x4")
    assert len(hard) == 6 * 3 * 2 and {t.point["seq_len"] for t in hard} == {64, 512}
    assert all(mqar.get_config(t.config.split(":", 1)[1]).data.batch_size == 64 for t in hard
               if t.point["seq_len"] == 512)
    with pytest.raises(ValueError, match=r"\(512, 8\)\] not in this variant's settings"):
        mqar.get_config("gpu_long,settings=512x8")
    with pytest.raises(ValueError, match="expected LxK entries"):
        mqar.get_config("gpu_long,settings=512-64")


def test_num_heads_is_its_own_axis_and_reaches_the_model():
    """`num_heads=1` (Zoology's attention) names its trials apart from the default d_model // 32
    heads, so they never overwrite or get skipped as the grid's trials, and sets every trial's
    attention to one head of width d_model."""
    plain = _trials("gpu_long,mixers=softmax,settings=512x64")
    one = _trials("gpu_long,mixers=softmax,settings=512x64,num_heads=1")
    assert len(one) == len(plain) == 3
    assert not {t.name for t in one} & {t.name for t in plain}
    for t in one:
        config = mqar.get_config(t.config.split(":", 1)[1])
        assert config.model.mixers.softmax.num_heads == 1
        assert config.model.mixers.softmax.head_dim == t.point["d_model"]
    default = mqar.get_config(plain[-1].config.split(":", 1)[1]).model.mixers.softmax
    assert (default.num_heads, default.head_dim) == (8, 32)  # d_model 256
    with pytest.raises(ValueError, match="num_heads=-1"):
        mqar.get_config("gpu_long,num_heads=-1")


def test_zoology_attention_form_is_its_own_axis_and_reaches_the_model():
    """rope=False,learned_pos=True,mlp=False (Zoology's attention) names its trials apart from the
    grid's and gives each trial NoPE attention, a position table of the trial's length and no
    MLP; the grid's trials keep RoPE, the MLP and no table."""
    plain = _trials("gpu_long,mixers=softmax,settings=256x16+512x64,widths=64")
    zoo = _trials("gpu_long,mixers=softmax,settings=256x16+512x64,widths=64,rope=False,learned_pos=True,mlp=False")
    assert len(zoo) == len(plain) == 2
    assert not {t.name for t in zoo} & {t.name for t in plain}
    for t in zoo:
        model = mqar.get_config(t.config.split(":", 1)[1]).model
        assert model.max_position_embeddings == t.point["seq_len"]
        assert model.mixers.softmax.rope_theta is None and model.ffn is False
    for t in plain:
        model = mqar.get_config(t.config.split(":", 1)[1]).model
        assert model.max_position_embeddings == 0
        assert model.mixers.softmax.rope_theta == 10000.0 and model.ffn is True
    with pytest.raises(ValueError, match="softmax_forms sweeps rope and mlp"):
        mqar.get_config("softmax_forms,mlp=False")


def test_zoology_attention_variant():
    """`zoology_attention`: softmax only, every width and setting at lr 1e-3 / 3e-3 (24 trials) in
    Zoology's form at Zoology's batch per length, named apart from gpu_long's trials; a key given
    explicitly wins (widths=64)."""
    trials = _trials("zoology_attention")
    assert len(trials) == 3 * 4 * 2 and {t.point["mixer"] for t in trials} == {"softmax"}
    assert sorted({t.point["lr"] for t in trials}) == [1e-3, 3e-3]
    assert not {t.name for t in trials} & {t.name for t in _trials("gpu_long,mixers=softmax")}
    batches = {}
    for t in trials:
        config = mqar.get_config(t.config.split(":", 1)[1])
        model = config.model
        assert model.max_position_embeddings == t.point["seq_len"] and model.ffn is False
        assert model.mixers.softmax.rope_theta is None and model.mixers.softmax.num_heads == 1
        assert model.embed_dropout == model.mixers.softmax.dropout == 0.1 and model.tie_embeddings is True
        assert config.total_steps == 12000
        batches[t.point["seq_len"]] = config.data.batch_size
    assert batches == {64: 512, 128: 512, 256: 256, 512: 128}  # Zoology's; gpu_long halves them
    assert len(_trials("zoology_attention,widths=64")) == 8


def test_train_examples_is_its_own_axis_and_reaches_the_data():
    plain = _trials("zoology_attention,widths=64,settings=512x64")
    fixed = _trials("zoology_attention,widths=64,settings=512x64,train_examples=100000")
    assert len(fixed) == len(plain) == 2 and not {t.name for t in fixed} & {t.name for t in plain}
    for t, want in [(t, 100000) for t in fixed] + [(t, 0) for t in plain]:
        assert mqar.get_config(t.config.split(":", 1)[1]).data.num_train_examples == want
    with pytest.raises(ValueError, match="train_examples=-5"):
        mqar.get_config("gpu_long,train_examples=-5")


def test_conv_form_drops_the_short_convolution_and_is_named_apart():
    """conv=False gives every recurrent mixer (the hybrid's KDA layers too) conv_size 0 in trials
    named apart from the grid's; the grid keeps its width-4 convolutions."""
    plain = _trials("gpu_long,mixers=linear+hybrid,settings=512x64,widths=64")
    bare = _trials("gpu_long,mixers=linear+hybrid,settings=512x64,widths=64,conv=False")
    assert len(bare) == len(plain) == 2
    assert not {t.name for t in bare} & {t.name for t in plain}
    for trials, size in ((bare, 0), (plain, 4)):
        for t in trials:
            mixers = mqar.get_config(t.config.split(":", 1)[1]).model.mixers
            recurrent = [m for name, m in mixers.items() if name in ("linear", "kda")]
            assert recurrent and all(m.conv_size == size for m in recurrent)
