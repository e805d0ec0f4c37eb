"""Pieces shared by every config file. Each section has one owner function; config files call
`base_config()` and then fill `config.model` (see `kimi_jax/config.py` for its schema)."""

from __future__ import annotations

import ml_collections


def parse_arg(arg: str | None, **spec):
    """Parse "key=value,key2=value2" into a ConfigDict with defaults and types from `spec`
    (big_vision's convention). A bare "key" sets a boolean to True. Unknown keys raise."""
    out = ml_collections.ConfigDict(spec)
    if not arg:
        return out
    for item in arg.split(","):
        key, _, value = item.partition("=")
        if key not in spec:
            raise ValueError(f"Unknown config arg {key!r}; expected one of {sorted(spec)}")
        default = spec[key]
        if isinstance(default, bool):
            out[key] = value.lower() in ("", "1", "true", "yes")
        elif value == "":
            raise ValueError(f"Config arg {key!r} needs a value")
        else:
            out[key] = type(default)(value)
    return out


def training_defaults(config: ml_collections.ConfigDict) -> None:
    """Loop keys of the contract (train.py reads these)."""
    config.seed = 0
    config.total_steps = 1000
    config.log_every_steps = 10
    config.eval_every_steps = 200
    config.checkpoint_every_steps = 200
    config.keep_checkpoints = 3
    config.profile_steps = ()
    # Peak FLOP/s of ONE device for MFU; 0 looks the device kind up (kimi_jax/logging_utils.py).
    config.peak_flops = 0.0
    # On a non-finite loss or gradient: False stops the run, True skips that update and goes on.
    config.skip_nonfinite_updates = False
    # Fault injection for tests of the non-finite handling: the loss of this step becomes NaN.
    config.inject_nan_at_step = -1
    # Launch multi-host runs with jax.distributed when the environment describes several processes.
    config.distributed = True
    # XLA compile options of the train step, "name=value,..." (e.g. "xla_allow_excess_precision=false":
    # intermediates the model declares bf16 are stored in bf16, not kept in float32); "" = XLA's defaults.
    config.xla_options = ""
    # Traced implementation settings, "key=value/..." (kimi_jax/kernel_settings.py: the KDA kernels'
    # block_v, grad_issue, segments, ..., the MoE's gate_up and pair_sort, the backward forms), in
    # place while train.py and eval.py trace their steps; "" = every default.
    config.kernel_settings = ""


def data_defaults() -> ml_collections.ConfigDict:
    """The input pipeline (kimi_jax/data). `kind` picks the source: "task" (a synthetic task
    generated on the fly), "tfds_task" (one materialised by `python -m kimi_jax.data.build`),
    "tfds" (a prepared TFDS text dataset by name) or "files" (local .txt / .jsonl files)."""
    data = ml_collections.ConfigDict()
    data.kind = "task"
    data.task = "mqar"
    # Zoology's smallest MQAR setting over a 256-token vocabulary (the tiny model's).
    data.task_kwargs = ml_collections.ConfigDict(dict(seq_len=64, num_kv_pairs=4, vocab_size=256))
    # Packed sequence length; 0 means the task's own sequence length.
    data.seq_len = 0
    # Global batch in sequences (split over hosts and the data/fsdp/expert mesh axes).
    data.batch_size = 32
    # kind "task": 0 = fresh examples every step; N > 0 = a fixed training set of N examples,
    # reshuffled every epoch (Zoology's MQAR: 100k). Evaluation always draws fresh examples.
    data.num_train_examples = 0
    # Held-out batches per in-training evaluation.
    data.eval_batches = 4
    # TFDS: dataset name (e.g. "lm1b") and folder holding prepared array_record datasets.
    data.tfds_name = ""
    data.data_dir = ""
    data.train_split = "train"
    data.eval_split = "test"
    data.text_key = "text"
    # Local files: comma-separated globs of .txt (one document per non-empty line) or .jsonl.
    data.files = ""
    data.eval_files = ""
    # Tokenizer for text: "byte" or "sentencepiece" (then `tokenizer_path` is the .model file).
    data.tokenizer = "byte"
    data.tokenizer_path = ""
    return data


def optim_defaults() -> ml_collections.ConfigDict:
    """Optimizer (kimi_jax/optim.py): AdamW or Muon, warmup + cosine/WSD, clipping, decay masks."""
    optim = ml_collections.ConfigDict()
    optim.name = "adamw"  # "adamw" | "muon"
    optim.lr = 1e-3
    optim.schedule = "cosine"  # "cosine" | "wsd" | "constant"
    optim.warmup_steps = 100
    # Final learning rate as a fraction of the peak (cosine and WSD).
    optim.min_lr_ratio = 0.1
    # WSD: fraction of the steps spent in the final decay.
    optim.decay_fraction = 0.2
    optim.b1 = 0.9
    optim.b2 = 0.95
    optim.eps = 1e-8
    optim.weight_decay = 0.1
    # Decay embedding tables too (norms, biases, A_log and dt_bias are never decayed).
    optim.decay_embeddings = False
    optim.clip_norm = 1.0  # 0 disables global-norm clipping
    optim.grad_accum_steps = 1
    # Dtype the forward/backward runs in; master weights and optimizer state stay float32.
    optim.compute_dtype = "float32"
    optim.z_loss = 0.0
    # Muon: momentum and the Adam learning rate (for embeddings, norms, vectors) relative to lr.
    optim.muon_beta = 0.95
    optim.muon_adam_lr_ratio = 1.0
    return optim


def mesh_defaults() -> ml_collections.ConfigDict:
    """Mesh axis sizes; one may be -1 (all remaining devices)."""
    return ml_collections.ConfigDict(dict(data=-1, fsdp=1, tensor=1, expert=1))


def base_config() -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict()
    training_defaults(config)
    config.model = ml_collections.ConfigDict()
    config.data = data_defaults()
    config.optim = optim_defaults()
    config.mesh = mesh_defaults()
    from configs.evals import evals_defaults  # config.evals (kimi_jax/evaluators)

    evals_defaults(config)
    return config
