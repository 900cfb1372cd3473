"""Typed config schemas (no Hydra import here: `mtp_train.cli.common` registers them in Hydra's ConfigStore).

`conf/config.yaml` starts its defaults list with `config_schema`, so every YAML group file is merged
into these dataclasses: a mistyped key or a value of the wrong type fails at compose time with
Hydra's message naming the key. Value rules (k >= 1, known loss names, non-negative lengths...) live
in `__post_init__` and run in `config_rules.validate()`, which every entry point calls first; each
message names the full config key so a user can fix the override they typed. A command judges only
the keys it reads (`config_rules.READS`): mtp-eval takes the heads' settings from the trained run, so
a loss or trainer value it never uses does not stop it.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING

from mtp_train.choices import (
    ADAPTIVE_POLICIES,
    BACKBONE_SOURCES,
    COMPILE_MODES,
    DATA_SOURCES,
    DATA_USES,
    DTYPES,
    EVAL_DTYPES,
    LABEL_SOURCES,
    LABEL_SPLITS,
    LOSS_NAMES,
    LR_SCHEDULES,
    PREDICTOR_KINDS,
    PROMPT_SOURCES,
    SEGMENT_RULES,
)
from mtp_train.config_rules import check, check_choice, check_k_fits, check_seed
from mtp_train.evaluation.modes import EVAL_MODES, MODES
from mtp_train.heads.registry import FAMILIES  # what each family accepts is its record's


@dataclass
class TinyBackboneConfig:
    """A random Llama built in code: tests and smoke runs need no download (`mtp-prep backbone=tiny` prepares its data in seconds)."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 128
    max_position_embeddings: int = 512
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size"):
            check(getattr(self, name) > 0, f"backbone.tiny.{name}", "must be > 0")
        check(self.hidden_size % self.num_heads == 0, "backbone.tiny.hidden_size",
               "must be divisible by backbone.tiny.num_heads")
        check(self.num_heads % self.num_kv_heads == 0, "backbone.tiny.num_kv_heads",
               "must divide backbone.tiny.num_heads")


@dataclass
class LoraConfig:
    enabled: bool = False
    r: int = 8
    alpha: int = 16
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "v_proj"])
    # weight of the term that keeps the adapted backbone's next-token distribution close to the
    # original's (KL(original || adapted) per token); 0 lets the adapters serve the heads alone
    distill_weight: float = 1.0
    lr: float | None = None  # the adapters' learning rate (None: train.lr)

    def __post_init__(self) -> None:
        check(self.r > 0, "backbone.lora.r", "must be > 0")
        check(0.0 <= self.dropout < 1.0, "backbone.lora.dropout", "must be in [0, 1)")
        check(self.distill_weight >= 0, "backbone.lora.distill_weight", "must be >= 0")
        check(self.lr is None or self.lr > 0, "backbone.lora.lr", "must be > 0 (or null for train.lr)")
        check(bool(self.target_modules), "backbone.lora.target_modules", "name at least one module")


@dataclass
class BackboneConfig:
    name: str = MISSING  # short name used in artifact paths
    source: str = "tiny"  # hf: hub id or local dir | gguf: a .gguf converted once | tiny: built in code
    path: str | None = None  # hf: id or directory; gguf: directory holding gguf_file
    gguf_package: str | None = None  # gguf: Python package shipping the file (found without importing it)
    gguf_file: str | None = None
    install_hint: str | None = None  # printed when the package or file is missing
    converted_dir: str | None = None  # gguf: where the safetensors copy is written and reused
    dtype: str = "float32"
    device: str = "auto"  # auto: cuda when available, else cpu
    tiny: TinyBackboneConfig = field(default_factory=TinyBackboneConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    # heads remember the backbone they were trained on (name and a fingerprint of its weights) and
    # are refused on any other; true loads them anyway, with a warning (for those who know why)
    allow_foreign_heads: bool = False

    def __post_init__(self) -> None:
        check_choice(self.source, BACKBONE_SOURCES, "backbone.source")
        check_choice(self.dtype, DTYPES, "backbone.dtype")
        check(self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
               "backbone.device", f"unknown device {self.device!r}; use auto, cpu or cuda[:N]")
        if self.source == "hf":
            check(bool(self.path), "backbone.path", "required when backbone.source=hf")
        if self.source == "gguf":
            check(bool(self.gguf_file), "backbone.gguf_file", "required when backbone.source=gguf")
            check(bool(self.path or self.gguf_package), "backbone.gguf_package",
                   "set backbone.gguf_package or backbone.path for a gguf backbone")
            check(bool(self.converted_dir), "backbone.converted_dir", "required for gguf")


MAX_K = 16


@dataclass
class HeadsConfig:
    type: str = "chained"
    k: int = 3
    num_layers: int = 1  # medusa: ResBlocks per head
    lm_head: str = "shared"  # shared (frozen, the backbone's) | copy (trainable)
    # score only the N most frequent training tokens (None = the whole vocabulary): see heads/vocab.py
    draft_vocab: int | None = None
    # chained: each module's block starts as a copy of the backbone's last layer (copy_last) or from
    # the architecture's own random init (random: the block then starts close to identity)
    init: str = "random"
    # chained: one module (projection, norms, block) applied at every depth instead of one per depth
    # (EAGLE's single draft layer): 1/k of the parameters, each trained by every depth's targets
    share: bool = False
    # eagle3: the backbone layers whose inputs the draft layer fuses (null = EAGLE-3's 2, L/2, L-3)
    aux_layers: list[int] | None = None
    # eagle3: the residual around attention is hidden_norm(h) instead of h
    norm_before_residual: bool = False
    # eagle3: start from a drafter saved by speculators (its trainer's checkpoint folder, or an
    # export: config.json + model.safetensors) instead of heads.init; trainer.max_steps=0 only
    # validates and writes it as this run's heads (for mtp-eval, mtp-clp, mtp-serve-check)
    from_speculators: str | None = None

    def __post_init__(self) -> None:
        check_choice(self.type, tuple(FAMILIES), "heads.type")
        fam = FAMILIES.get(self.type)
        if fam is None:  # unknown, and not judged by this command (mtp-eval reads the run's heads.json)
            return
        check(self.k >= 1, "heads.k", f"must be >= 1, got {self.k}")
        # the validation's rank statistics count (R + 1)^k cells per entropy bucket, R >= 1
        check(self.k <= MAX_K, "heads.k", f"at most {MAX_K} (deeper drafts are all but never accepted, "
                                           f"and the tree statistics would not fit), got {self.k}")
        check(self.num_layers >= 1, "heads.num_layers", f"must be >= 1, got {self.num_layers}")
        check(self.draft_vocab is None or self.draft_vocab >= 2, "heads.draft_vocab",
               f"must be >= 2 or null (the whole vocabulary), got {self.draft_vocab}")
        for key, value, accepted, known in (
                ("heads.init", self.init, fam.inits, [v for f in FAMILIES.values() for v in f.inits]),
                ("heads.lm_head", self.lm_head, fam.lm_heads, [v for f in FAMILIES.values() for v in f.lm_heads])):
            check_choice(value, tuple(dict.fromkeys(known)), key)
            check(value in accepted, key, f"{value!r} is not for {self.type} heads ({fam.what}); they "
                                           f"take {' or '.join(accepted)}")
        check(self.from_speculators is None or self.type == "eagle3", "heads.from_speculators",
              f"reads EAGLE-3 drafters; these heads are {self.type} (set heads=eagle3)")
        check(self.aux_layers is None or fam.reads_aux, "heads.aux_layers",
               f"names backbone layers for heads that read them besides the final state "
               f"({', '.join(f.name for f in FAMILIES.values() if f.reads_aux)}); leave it null for {self.type}")
        if self.aux_layers is not None:
            self.aux_layers = sorted(int(i) for i in self.aux_layers)  # the order engines collect them in
            check(len(self.aux_layers) >= 1 and len(set(self.aux_layers)) == len(self.aux_layers)
                   and min(self.aux_layers) >= 0, "heads.aux_layers",
                   f"must be distinct layer ids >= 0, got {self.aux_layers}")
        check(not self.share or fam.shares_modules, "heads.share",
               f"shares one module across depths; {self.type} heads have none to share ({fam.what})")


@dataclass
class LossSchedule:
    """Switch losses during training: loss.name until `at` x trainer.max_steps, then `then`."""

    then: str | None = None  # null: loss.name throughout
    at: float = 0.5

    def __post_init__(self) -> None:
        if self.then is not None:
            check_choice(self.then, LOSS_NAMES, "loss.schedule.then")
        check(0 <= self.at <= 1, "loss.schedule.at", f"must be a fraction of the steps in [0, 1], got {self.at}")


@dataclass
class LossConfig:
    name: str = "kl"  # KL trained every depth best in the recipe comparisons (docs/results.md)
    depth_weights: list[float] | None = None  # lambda_j per depth; None = all ones
    schedule: LossSchedule = field(default_factory=LossSchedule)
    # top-K distillation (HASS): + topk_weight x CE of each head against the backbone's K most
    # likely tokens (their probabilities renormalised), which rewards ranking them 2..K, where token
    # trees look for drafts; 0 = off
    topk: int = 0
    topk_weight: float = 1.0
    adamtp: bool = False
    segment_rule: str = "diff"
    theta: float = 1.0  # diff rule: boundary when H_t - H_{t-1} > theta
    zscore_window: int = 16
    zscore_threshold: float = 2.0

    def __post_init__(self) -> None:
        check_choice(self.name, LOSS_NAMES, "loss.name")
        check_choice(self.segment_rule, SEGMENT_RULES, "loss.segment_rule")
        check(self.zscore_window >= 2, "loss.zscore_window", "must be >= 2")
        for key in ("theta", "zscore_threshold", "topk_weight"):  # nan compares false: a mask that never fires
            check(math.isfinite(getattr(self, key)), f"loss.{key}", f"must be a finite number, got {getattr(self, key)}")
        check(self.topk >= 0, "loss.topk", f"must be >= 0 (0 = off), got {self.topk}")
        check(self.topk_weight >= 0, "loss.topk_weight", f"must be >= 0, got {self.topk_weight}")
        if self.depth_weights is not None:
            check(all(w >= 0 for w in self.depth_weights), "loss.depth_weights",
                   "weights must be >= 0")
            check(sum(self.depth_weights) > 0, "loss.depth_weights", "all zero: no depth would train")

    def name_at(self, step: int, max_steps: int) -> str:
        """The loss in force at optimizer step `step` of `max_steps`."""
        s = self.schedule
        return s.then if s.then is not None and step >= s.at * max_steps else self.name


@dataclass
class DistillConfig:
    """Self-distillation: the backbone rewrites the assistant answers of the prompts."""

    enabled: bool = True
    max_new_tokens: int = 128
    max_prompt_tokens: int = 512
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.95
    batch_size: int = 8
    shard_size: int = 64
    max_train_prompts: int | None = None  # None: every train prompt
    max_val_prompts: int | None = None
    # under budget.distill_share, the train prompts distilled before the deadline's share may stop it
    min_train_prompts: int = 0
    # auto: bfloat16 where the hardware has it (CUDA, AVX512-BF16/AMX CPUs), else float32; the
    # hidden-state cache computes in the same dtype (so it can reuse the states kept below)
    autocast: str = "auto"
    keep_states: bool = True  # keep the backbone's hidden states of the distilled rows for the cache
    seed: int = 0
    # hf: HF generate in this process; vllm: the serving engine (vLLM's CPU build in its own venv,
    # mtp_train/engine/), about 2x faster at batch 32 (docs/serving.md), greedy only, keeps no states
    # (the cache stage then runs the backbone over the distilled rows)
    engine: str = "hf"

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_prompt_tokens", "batch_size", "shard_size"):
            check(getattr(self, name) > 0, f"data.distill.{name}", "must be > 0")
        for name in ("max_train_prompts", "max_val_prompts"):
            v = getattr(self, name)
            check(v is None or v >= 0, f"data.distill.{name}", "must be >= 0 or null")
        check(self.min_train_prompts >= 0, "data.distill.min_train_prompts", "must be >= 0")
        check(self.temperature > 0, "data.distill.temperature", "must be > 0")
        check(0 < self.top_p <= 1, "data.distill.top_p", "must be in (0, 1]")
        check_choice(self.autocast, ("auto", *DTYPES), "data.distill.autocast")
        check_seed(self.seed, "data.distill.seed")
        check_choice(self.engine, ("hf", "vllm"), "data.distill.engine")
        check(self.engine == "hf" or not self.do_sample, "data.distill.engine",
              "vllm distils greedily only (data.distill.do_sample=true needs engine=hf)")


@dataclass
class DataConfig:
    name: str = MISSING
    source: str = "sharegpt"
    path: str | None = None  # jsonl file / saved dataset directory; sharegpt: None = bundled file
    max_length: int = 1024  # tokens per rendered conversation (longer ones are truncated)
    max_conversations: int | None = None  # random subset (by seed) after parsing; None = all
    val_fraction: float = 0.05
    min_val_rows: int = 1  # at least this many validation rows
    seed: int = 0
    num_proc: int = 1
    output_dir: str = MISSING
    tiny_rows: int = 96  # source=tiny: how many conversations to make
    distill: DistillConfig = field(default_factory=DistillConfig)

    def __post_init__(self) -> None:
        check_choice(self.source, DATA_SOURCES, "data.source")
        check_seed(self.seed, "data.seed")
        if self.source in ("jsonl", "disk"):
            check(bool(self.path), "data.path", f"required when data.source={self.source}")
        check(self.max_length > 0, "data.max_length", f"must be > 0, got {self.max_length}")
        check(self.max_conversations is None or self.max_conversations > 0,
               "data.max_conversations", "must be > 0 or null")
        check(0.0 < self.val_fraction < 1.0, "data.val_fraction", "must be in (0, 1)")
        check(self.min_val_rows >= 1, "data.min_val_rows", "must be >= 1 (training validates)")
        check(self.num_proc >= 1, "data.num_proc", "must be >= 1")
        check(self.tiny_rows > 1, "data.tiny_rows", "must be > 1")


@dataclass
class TrainConfig:
    """What mtp-train reads besides heads/loss/trainer: the data it uses and the optimiser."""

    data_use: str = "distilled"  # distilled | labelled | mix (both)
    batch_size: int = 4
    max_length: int | None = None  # crop rows to this many tokens (None: data.max_length)
    lr: float = 1e-3
    weight_decay: float = 0.0
    # AdamW's (beta1, beta2); torch's default second-moment average spans ~1000 steps, EAGLE trains at (0.9, 0.95)
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1
    # after warm-up: cosine (to min_lr_ratio x lr), constant, or wsd (warmup-stable-decay: constant,
    # then a cosine decay to min_lr_ratio over the last decay_fraction of the steps)
    lr_schedule: str = "cosine"
    decay_fraction: float = 0.2
    num_workers: int = 0
    use_cache: bool = True  # read hidden states from `mtp-prep stage=cache` when it matches
    data_fraction: float = 1.0  # train on the first fraction of each dataset's training rows (scaling curves)
    # batches of rows of similar length, drawn from windows of this many random batches sorted by
    # length (less padding, the same rows per step); 0 or 1: random batches
    length_window: int = 16
    # after training, decode with the new heads as mtp-eval does (the eval.* settings) into
    # <run dir>/eval: in a sweep, every point on the same prompts, and the summary shows its tau and speedup
    eval_after: bool = False
    # validation predicts speculative sampling's accepted length at each of these temperatures
    # (val/sim_tau_t0.7, ...); a metric only, not part of the recipe
    # (over a draft vocabulary, each T other than 1 costs one full LM-head projection per validation row)
    sampled_tau_temperatures: list[float] = field(default_factory=lambda: [1.0])
    # train to a time budget: minutes of wall time for the fit (steps and validations). The number
    # of steps is planned from the measured step time and revised as training goes, and
    # train.lr_schedule runs over the planned steps, so it ends where the budget does; trainer.max_steps
    # is then a cap and train.min_steps a floor (mtp_train/lit/budget.py). null: trainer.max_steps
    # steps, or, with budget.deadline, the time left before it minus what follows training
    time_budget_min: float | None = None
    min_steps: int = 50
    # uniform noise on the states the heads read while training, in [-x, x] x each vector's RMS
    # (EAGLE's trick for the drift of fed-back states; 0: none)
    feature_noise: float = 0.0
    # torch.compile of the heads' forward while training: off, on, or auto (on a CPU, time a compiled
    # step against an eager one on the first batches and keep whichever is faster; skipped when the
    # run is too short to pay the compile back). Weights and checkpoints are the same either way
    compile: str = "off"

    def __post_init__(self) -> None:
        check_choice(self.data_use, DATA_USES, "train.data_use")
        self.compile = {"true": "on", "false": "off"}.get(str(self.compile).lower(), str(self.compile).lower())
        check_choice(self.compile, COMPILE_MODES, "train.compile")
        check(self.time_budget_min is None or (math.isfinite(self.time_budget_min) and self.time_budget_min > 0),
              "train.time_budget_min", f"must be a number of minutes > 0 or null, got {self.time_budget_min}")
        check(self.min_steps >= 1, "train.min_steps", f"must be >= 1, got {self.min_steps}")
        check(math.isfinite(self.feature_noise) and 0 <= self.feature_noise <= 1, "train.feature_noise",
              f"must be in [0, 1] (a fraction of each state's RMS), got {self.feature_noise}")
        check(self.num_workers >= 0, "train.num_workers", f"must be >= 0, got {self.num_workers}")
        check(0 < self.data_fraction <= 1, "train.data_fraction", "must be in (0, 1]")
        check(self.batch_size > 0, "train.batch_size", "must be > 0")
        check(self.length_window >= 0, "train.length_window", f"must be >= 0, got {self.length_window}")
        check(self.max_length is None or self.max_length > 1, "train.max_length", "must be > 1 or null")
        check(math.isfinite(self.lr) and self.lr > 0, "train.lr", f"must be a finite number > 0, got {self.lr}")
        check(math.isfinite(self.weight_decay) and self.weight_decay >= 0, "train.weight_decay",
              f"must be a finite number >= 0, got {self.weight_decay}")
        check(len(self.adam_betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in self.adam_betas),
              "train.adam_betas", f"must be two numbers in [0, 1), got {self.adam_betas}")
        check(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0")
        check(0 <= self.min_lr_ratio <= 1, "train.min_lr_ratio", "must be in [0, 1]")
        check_choice(self.lr_schedule, LR_SCHEDULES, "train.lr_schedule")
        check(0 < self.decay_fraction <= 1, "train.decay_fraction", "must be in (0, 1]")
        temps = list(self.sampled_tau_temperatures)
        check(all(math.isfinite(t) and t > 0 for t in temps), "train.sampled_tau_temperatures",
              f"each must be > 0 (greedy verification is val/sim_tau), got {temps}")
        check(len({f"{t:.1f}" for t in temps}) == len(temps), "train.sampled_tau_temperatures",
              f"must differ at one decimal place (each names a metric val/sim_tau_t<T>), got {temps}")




@dataclass
class BudgetConfig:
    """A wall-clock deadline for a pipeline run stage by stage (make demo sets it): the stages that
    can be sized size themselves to end by it. Distillation takes at most `distill_share` of the time
    left when it starts (data.distill.min_train_prompts at least), and a stopped one limits the
    original answers read to the conversations it reached. Training takes the time left before
    the deadline minus what the stages after it are predicted to take (`after_train`, from the
    backbone's decoding speed measured on this machine; mtp_train/pipeline/budget.py) and minus
    `margin_min`; the sampled runs of the evaluation are left out of that prediction where counting
    them would leave training fewer than `train_first_min` minutes."""

    deadline: float | None = None  # unix time (seconds); null: no deadline
    after_train: list[str] = field(default_factory=list)  # stages run after training: clp, eval
    margin_min: float = 1.0
    distill_share: float = 0.0  # 0: distillation answers every planned prompt, deadline or not
    # minutes of training that come before the sampled runs' reserve: where reserving them would leave
    # training fewer, they are not reserved, and mtp-eval runs them only if its greedy decodes leave time
    train_first_min: float = 0.0

    def __post_init__(self) -> None:
        check(self.deadline is None or math.isfinite(self.deadline), "budget.deadline",
              f"must be a unix time in seconds or null, got {self.deadline}")
        for s in self.after_train:
            check_choice(s, ("clp", "eval"), "budget.after_train")
        check(math.isfinite(self.margin_min) and self.margin_min >= 0, "budget.margin_min",
              f"must be a number of minutes >= 0, got {self.margin_min}")
        check(0 <= self.distill_share <= 1, "budget.distill_share",
              f"must be a share of the time left in [0, 1], got {self.distill_share}")
        check(math.isfinite(self.train_first_min) and self.train_first_min >= 0, "budget.train_first_min",
              f"must be a number of minutes >= 0, got {self.train_first_min}")


@dataclass
class ClpConfig:
    """mtp-clp: acceptance labels from decoding with trained heads, predictors fitted on them."""

    train_run: str | None = None  # the mtp-train run directory whose heads make the labels
    # where labels come from: "cache" = every answer position of the self-distilled training rows
    # in the hidden-state cache (the backbone's own greedy text; no decoding, seconds), "decode" =
    # decode n_prompts training prompts with the heads, "auto" = cache when there is one
    label_source: str = "auto"
    # which cache split the labels come from: "validation" = self-distilled rows the heads never
    # trained on (their acceptance there is what decoding meets), "train" = the training rows (more
    # labels, but the heads fit them, so long spans come out too often)
    label_split: str = "validation"
    n_prompts: int = 32  # training-split prompts decoded for labels (label_source=decode)
    max_new_tokens: int = 128
    shard_prompts: int = 8  # prompts per resumable shard
    val_fraction: float = 0.2  # of the labelled prompts, held out while fitting
    kinds: list[str] = field(default_factory=lambda: list(PREDICTOR_KINDS))
    use_head_probs: bool = False  # features: hidden state (+ the heads' top-1 probabilities)
    epochs: int = 40
    batch_size: int = 256
    lr: float = 3e-3
    calib_prompts: int = 6  # held-out prompts decoded per threshold
    # CLP commits m drafts unverified where P(L >= m) >= threshold; calibration keeps the one with
    # the most tokens per step (tau) within the bounds below (a threshold of 1.0 commits none)
    thresholds: list[float] = field(default_factory=lambda: [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2])
    max_repetition_increase: float = 0.02  # calibration bounds against plain greedy decoding
    max_nll_increase: float = 0.10  # nats per token
    # the bounds hold for the paired per-prompt increase's mean plus this many standard errors
    # (0: the mean alone, as before; docs/algorithms.md, "CLP")
    bound_z: float = 1.0
    # decode the thresholds from the highest down and stop after the first outside the bounds
    stop_at_failure: bool = True

    def __post_init__(self) -> None:
        check(all(0 < t <= 1 for t in self.thresholds) and len(self.thresholds) > 0, "clp.thresholds",
               "must be values in (0, 1]")
        check(self.calib_prompts > 0, "clp.calib_prompts", "must be > 0")
        check(self.bound_z >= 0, "clp.bound_z", "must be >= 0 (standard errors added to the mean increase)")
        check_choice(self.label_source, LABEL_SOURCES, "clp.label_source")
        check_choice(self.label_split, LABEL_SPLITS, "clp.label_split")
        for kind in self.kinds:
            check_choice(kind, PREDICTOR_KINDS, "clp.kinds")
        check(len(self.kinds) > 0 and len(set(self.kinds)) == len(self.kinds), "clp.kinds",
               f"name each predictor kind once, at least one (clp, gate), got {list(self.kinds)}")
        check(self.n_prompts > 0, "clp.n_prompts", "must be > 0")
        check(self.max_new_tokens > 1, "clp.max_new_tokens", "must be > 1")
        check(self.shard_prompts > 0, "clp.shard_prompts", "must be > 0")
        check(0 < self.val_fraction < 1, "clp.val_fraction", "must be in (0, 1)")
        check(self.epochs > 0 and self.batch_size > 0 and self.lr > 0, "clp.epochs",
               "epochs, batch_size and lr must be > 0")


@dataclass
class SamplingConfig:
    """eval.sampling: the lossless modes also decoded with speculative sampling, against HF generate
    with do_sample=True and the same warpers (docs/decoding.md, "Speculative sampling")."""

    temperatures: list[float] = field(default_factory=list)  # each > 0 is one sampled run; 0 = the greedy run
    top_k: int = 0  # 0: no top-k
    top_p: float = 1.0  # 1: no top-p
    min_p: float | None = None
    modes: list[str] | None = None  # which of eval.modes sample; None = every one that can
    samples: int = 1  # seeded samples per prompt (more make a sampled tau steadier)
    seed: int = 0  # sample j of prompt i draws from a generator seeded with seed, i and j

    def __post_init__(self) -> None:
        for t in self.temperatures:
            check(math.isfinite(t) and t >= 0, "eval.sampling.temperatures",
                  f"must be finite and >= 0 (0: greedy), got {t}")
        check(self.top_k >= 0, "eval.sampling.top_k", f"must be >= 0 (0 keeps every token), got {self.top_k}")
        check(0 < self.top_p <= 1, "eval.sampling.top_p", f"must be in (0, 1], got {self.top_p}")
        check(self.min_p is None or 0 <= self.min_p <= 1, "eval.sampling.min_p", "must be in [0, 1] or null")
        check(self.samples >= 1, "eval.sampling.samples", f"must be >= 1, got {self.samples}")
        for m in self.modes or ():
            check_choice(m, tuple(EVAL_MODES), "eval.sampling.modes")
            check(MODES[m].cannot_sample is None, "eval.sampling.modes", f"{m} cannot sample: it {MODES[m].cannot_sample}")

    @property
    def temperatures_sampled(self) -> list[float]:
        return [t for t in self.temperatures if t > 0]


@dataclass
class EvalConfig:
    """mtp-eval: which heads, which prompts, which decoding modes (HF generate greedy always runs)."""

    train_run: str | None = None  # the mtp-train run directory whose heads (heads.safetensors + .json) decode
    clp_run: str | None = None  # the mtp-clp run directory whose predictors (clp/, gate/) the span modes use
    prompts: str | None = None  # JSONL with {"prompt": ...} rows; None = eval.prompt_source
    prompt_source: str = "validation"  # without eval.prompts: validation (held-out split) | unseen
    n_prompts: int | None = 8  # first N prompts (None = all)
    max_new_tokens: int = 128
    max_prompt_tokens: int = 1024  # longer prompts are skipped (counted in the report)
    modes: list[str] = field(default_factory=lambda: ["greedy", "verify"])
    warmup: int = 1  # prompts decoded once per mode before timing
    dtype: str = "auto"  # float32 | bfloat16 | auto (bf16 where matmuls have native bf16: AMX, avx512_bf16, GPU)
    tree_nodes: int | None = None  # tree: draft nodes of the static tree; None = chosen by measured cost
    tree_budgets: list[int] = field(default_factory=lambda: [3, 4, 5, 7, 9, 11, 15, 23, 31, 47, 63])
    dynamic_topk: int = 4  # dynamic: candidates per expanded node, and nodes expanded per level
    rounds: int = 3  # timing rounds (modes in a rotating order); speedups are the median over rounds
    delta: float = 0.3  # relaxed: keep d_i while p(d_i) >= delta * max p ...
    budget: float = 1.0  # ... and the summed log-prob drift stays <= budget (0 = verify)
    adaptive_policy: str = "cost"  # cost | entropy
    entropy_low: float = 0.5  # adaptive entropy policy: all heads at or below (nats)
    entropy_high: float = 3.0  # no head at or above
    # clp, gate, clp+verify at this threshold instead of the calibrated one (to map the trade-off)
    span_threshold: float | None = None
    sampling: SamplingConfig = field(default_factory=SamplingConfig)

    def __post_init__(self) -> None:
        check(self.span_threshold is None or 0 < self.span_threshold <= 1, "eval.span_threshold",
               "must be in (0, 1] or null")
        for m in self.modes:
            check_choice(m, tuple(EVAL_MODES), "eval.modes")
        check(len(set(self.modes)) == len(self.modes), "eval.modes", "lists a mode twice")
        check(self.n_prompts is None or self.n_prompts > 0, "eval.n_prompts", "must be > 0 or null")
        check(self.max_new_tokens > 0, "eval.max_new_tokens", "must be > 0")
        check(self.max_prompt_tokens > 0, "eval.max_prompt_tokens", "must be > 0")
        check(self.warmup >= 0, "eval.warmup", "must be >= 0")
        check(self.rounds >= 1, "eval.rounds", f"must be >= 1, got {self.rounds}")
        check_choice(self.dtype, EVAL_DTYPES, "eval.dtype")
        check(self.tree_nodes is None or 1 <= self.tree_nodes <= 128, "eval.tree_nodes", "must be in 1..128 or null")
        check(bool(self.tree_budgets) and all(1 <= b <= 128 for b in self.tree_budgets), "eval.tree_budgets",
               "must list node budgets in 1..128")
        check(self.dynamic_topk >= 1, "eval.dynamic_topk", "must be >= 1")
        check_choice(self.prompt_source, PROMPT_SOURCES, "eval.prompt_source")
        check(self.prompt_source == "validation" or not self.prompts, "eval.prompt_source",
               f"{self.prompt_source} reads the data source; it cannot be combined with eval.prompts "
               "(set eval.prompts=null or eval.prompt_source=validation)")
        check(0 < self.delta <= 1, "eval.delta", "must be in (0, 1]")
        check(self.budget >= 0, "eval.budget", "must be >= 0")
        check_choice(self.adaptive_policy, ADAPTIVE_POLICIES, "eval.adaptive_policy")
        check(self.entropy_low < self.entropy_high, "eval.entropy_low", "must be below eval.entropy_high")
        for m in self.sampling.modes or ():
            check(m in self.modes, "eval.sampling.modes", f"{m} is not in eval.modes {self.modes}")

    def sampled_modes(self) -> list[str]:
        """The modes decoded under sampling: eval.sampling.modes, or every one of eval.modes that can."""
        if self.sampling.modes is not None:
            return list(self.sampling.modes)
        return [m for m in self.modes if MODES[m].cannot_sample is None]

    def check_inputs(self) -> None:
        """What only mtp-eval needs (the schema's defaults must construct without heads)."""
        drafting = [m for m in self.modes if MODES[m].drafts != "none"]
        check(not drafting or self.train_run is not None, "eval.train_run",
              f"modes {drafting} need trained heads: eval.train_run=<an mtp-train run directory>")
        needing = [m for m in self.modes if MODES[m].predictor is not None]  # a span predictor each
        check(not needing or self.clp_run is not None, "eval.clp_run",
              f"mode(s) {', '.join(needing)} need fitted span predictors: eval.clp_run=<an mtp-clp run directory>")


@dataclass
class PathsConfig:
    root_dir: str = MISSING
    cache_dir: str = MISSING  # converted backbones and other reusable artifacts
    data_dir: str = MISSING  # prepared datasets
    output_dir: str = MISSING  # this run's Hydra output directory

    def __post_init__(self) -> None:
        for key in ("root_dir", "data_dir", "cache_dir"):  # a file there failed later, blaming a manifest
            value = getattr(self, key)
            check(not (isinstance(value, str) and os.path.exists(value) and not os.path.isdir(value)),
                  f"paths.{key}", f"{value} is a file, not a directory"
                  + (" (paths.root_dir comes from $MTP_ROOT when it is set)" if key == "root_dir" else ""))


@dataclass
class Config:
    stage: str = "all"
    seed: int = 0
    force: bool = False  # rerun a stage even when its manifest says it is up to date
    experiment_name: str = "default"
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    clp: ClpConfig = field(default_factory=ClpConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    trainer: dict[str, Any] = field(default_factory=dict)  # kwargs of lightning.Trainer
    logger: dict[str, Any] | None = None  # name -> instantiable logger config

    def __post_init__(self) -> None:
        check_seed(self.seed, "seed")
        w = self.loss.depth_weights
        check(w is None or len(w) == self.heads.k, "loss.depth_weights",
               f"needs one weight per head (heads.k={self.heads.k}), got {None if w is None else len(w)}")
        crop = self.train.max_length or self.data.max_length  # what layout.max_length gives training
        check_k_fits(self.heads.k, crop, f"rows are cropped to {crop} (train.max_length, else data.max_length)")
