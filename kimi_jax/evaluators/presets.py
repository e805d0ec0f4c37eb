"""Suite presets: task name -> list of `make_task` settings. "paper" follows the published
protocols (see the recall-task notes: Zoology, Kimi Linear, Mamba, RULER); "cpu" keeps every task at
lengths a CPU evaluates in minutes."""

from __future__ import annotations

NIAH = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multikey_2",
        "niah_multikey_3", "niah_multivalue", "niah_multiquery")


def _grid(**lengths) -> dict:
    """{task: [dict(seq_len=L), ...]} from task=lengths keyword arguments."""
    return {name: [dict(seq_len=L) for L in ls] for name, ls in lengths.items()}


def paper_suite() -> dict:
    """Published protocols' settings (recall_tasks.md): accelerator scale."""
    return {
        # Zoology Fig. 2 (L, K) grid; L=512 needs vocab > 512.
        "mqar": [dict(seq_len=L, num_kv_pairs=K) for L, K in ((64, 4), (128, 8), (256, 16), (512, 64))],
        # Kimi Linear Fig. 4 training lengths.
        **_grid(mqar_kimi=(256, 512, 1024, 2048), palindrome=(256, 512, 1024, 2048),
                stack=(256, 512, 1024, 2048)),
        # Mamba: selective copying at 4096; induction heads trained at 256, tested to 1024.
        **_grid(selective_copying=(4096,), induction_heads=(256, 512, 1024),
                phonebook=(1024, 2048, 4096)),
        **{name: [dict(seq_len=L) for L in (1024, 2048, 4096, 8192)] for name in NIAH},
    }


def cpu_suite() -> dict:
    """The same tasks at lengths a CPU evaluates in minutes (the default)."""
    return {
        "mqar": [dict(seq_len=L, num_kv_pairs=K) for L, K in ((64, 4), (128, 8), (256, 16))],
        **_grid(mqar_kimi=(256,), palindrome=(256,), stack=(256,), selective_copying=(256,),
                induction_heads=(256, 512), phonebook=(512,)),
        **{name: [dict(seq_len=1024)] for name in NIAH},
    }


PRESETS = {"cpu": cpu_suite, "paper": paper_suite}


def suite(ev) -> dict:
    """The suite of an evals config: its preset, updated with the entries of `ev.suite`."""
    if ev.preset not in PRESETS:
        raise ValueError(f"Unknown evals.preset {ev.preset!r}; expected one of {sorted(PRESETS)}")
    return {**PRESETS[ev.preset](), **{k: list(v) for k, v in ev.suite.items()}}
