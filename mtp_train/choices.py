"""Every enumerated choice of the project, defined once: config validation, the code that acts on
the choice and the docs read these. No imports: the config schema and pure-torch modules both use it."""

from __future__ import annotations

BACKBONE_SOURCES = ("hf", "gguf", "tiny")
DATA_SOURCES = ("sharegpt", "jsonl", "disk", "tiny")
DTYPES = ("float32", "bfloat16", "float16")
HEAD_TYPES = ("medusa", "chained", "eagle3")
HEAD_LM = ("shared", "copy")  # medusa, eagle3: the backbone's LM head (frozen), or a trainable copy
# chained: a block starts as the backbone's last layer, or random; eagle3: fc random, or the
# least-squares map from the auxiliary states to the backbone's final state (final_state)
HEAD_INITS = ("copy_last", "random", "final_state")
LOSS_NAMES = ("ce", "kl", "tv", "e2e_tv")
SEGMENT_RULES = ("diff", "zscore")  # AdaMTP's entropy-surge rule
LR_SCHEDULES = ("cosine", "constant", "wsd")
DATA_USES = ("distilled", "labelled", "mix")  # train.data_use: which prepared datasets train
PREDICTOR_KINDS = ("clp", "gate")  # mtp-clp's span-length predictors (clp.kinds)
LABEL_SOURCES = ("auto", "cache", "decode")  # clp.label_source
LABEL_SPLITS = ("validation", "train")  # clp.label_split

# what `Decoder.generate` runs
DECODER_MODES = ("greedy", "verify", "relaxed", "clp", "clp+verify", "adaptive")
# what mtp-eval measures (eval.modes), each with the decoder mode it runs: trees are verify over a
# token tree (static or dynamic), the gate is a span policy in clp mode
EVAL_MODES = {"greedy": "greedy", "verify": "verify", "tree": "verify", "dynamic": "verify",
              "relaxed": "relaxed", "clp": "clp", "gate": "clp", "clp+verify": "clp+verify",
              "adaptive": "adaptive"}
# the modes whose output must equal greedy's (relaxed, clp and the gate trade that for speed)
LOSSLESS_EVAL_MODES = ("greedy", "verify", "tree", "dynamic", "clp+verify", "adaptive")

ADAPTIVE_POLICIES = ("cost", "entropy")  # eval.adaptive_policy
PROMPT_SOURCES = ("validation", "unseen")  # eval.prompt_source without eval.prompts
EVAL_DTYPES = ("auto", "float32", "bfloat16")

EXPORT_FORMATS = ("native", "eagle3", "medusa")  # mtp-export-heads --format

IGNORE_INDEX = -100  # a token position with no target (labels), as torch's cross-entropy reads it
