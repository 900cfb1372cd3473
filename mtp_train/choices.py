"""Every enumerated choice of the project, defined once: config validation, the code that acts on
the choice and the docs read these. No imports: the config schema and pure-torch modules both use it."""

from __future__ import annotations

BACKBONE_SOURCES = ("hf", "gguf", "tiny")
DATA_SOURCES = ("sharegpt", "jsonl", "disk", "tiny")
DTYPES = ("float32", "bfloat16", "float16")
# head families (heads.type) and the settings each accepts: mtp_train/heads/registry.py
LOSS_NAMES = ("ce", "kl", "tv", "e2e_tv")
SEGMENT_RULES = ("diff", "zscore")  # AdaMTP's entropy-surge rule
LR_SCHEDULES = ("cosine", "constant", "wsd")
COMPILE_MODES = ("off", "on", "auto")  # train.compile: torch.compile of the heads' forward
DATA_USES = ("distilled", "labelled", "mix")  # train.data_use: which prepared datasets train
PREDICTOR_KINDS = ("clp", "gate")  # mtp-clp's span-length predictors (clp.kinds)
LABEL_SOURCES = ("auto", "cache", "decode")  # clp.label_source
LABEL_SPLITS = ("validation", "train")  # clp.label_split

# decoding modes (eval.modes): mtp_train/evaluation/modes.py

ADAPTIVE_POLICIES = ("cost", "entropy")  # eval.adaptive_policy
PROMPT_SOURCES = ("validation", "unseen")  # eval.prompt_source without eval.prompts
EVAL_DTYPES = ("auto", "float32", "bfloat16")

IGNORE_INDEX = -100  # a token position with no target (labels), as torch's cross-entropy reads it
