"""Where every artifact lives: the one module that names the files and folders the project writes.

Prepared data (under `data.output_dir`, written by `mtp-prep`):
    labelled/        the chat-templated dataset with assistant-only token masks (Arrow + manifest)
    distilled/       the same prompts answered by the backbone itself
    cache-<key>/     the backbone's hidden states and per-token stats for the rows mtp-train reads

A training run (`mtp-train`, its Hydra run directory):
    heads.safetensors, heads.json      the trained heads and what made them
    adapter/                           with backbone.lora: the LoRA adapters trained with them (PEFT format)
    tree_stats.json                    per-depth rank statistics that token trees are grown from
    run_meta.json, run_config.yaml     what the checkpoints were made for; the resolved config
    checkpoints/last.ckpt              Lightning's (a directory of shards under DeepSpeed ZeRO)
    superseded/<recipe>/               what a changed recipe or force=true moved aside

A CLP run (`mtp-clp`): acceptance_labels/, one folder per predictor kind (predictor.safetensors + predictor.json),
stage_times.json. An evaluation (`mtp-eval`): eval_report.json, outputs.json and its plots.
The demo pipeline (`make demo`) puts them under one root as train/, clp/, eval/ and report.md.

Nothing here imports torch, Lightning or Hydra.
"""

from __future__ import annotations

from pathlib import Path

# --- any stage -----------------------------------------------------------------------------------
MANIFEST = "manifest.json"  # beside every prepared dataset, cache and label set: what made it
PLAN = "plan.json"  # a resumable sharded stage's plan (distillation, CLP labels)
SHARD_META = "shard.json"
SHARD_STATES = "states.npy"  # in a distillation shard: its rows' hidden states (cache shard format)
FAILED = "FAILED.txt"  # in a sweep point's run directory: why it failed (written by the entry point)
HYDRA_DIR = ".hydra"
RUN_LOCK, LOCK_HOLDER = ".mtp-run.lock", ".mtp-run.holder.json"  # one command per run directory


def shards_dir(out: str | Path) -> Path:
    """Where a resumable sharded stage (distillation, CLP labels) keeps finished shards of `out`."""
    out = Path(out)
    return out.with_name(out.name + ".shards")


def stage_lock(stage: str) -> str:
    """The lock file that lets one of several processes (sweep points) build a prepared stage."""
    return f".{stage}.lock"

# --- prepared data -------------------------------------------------------------------------------
LABELLED, DISTILLED, CACHE_PREFIX = "labelled", "distilled", "cache-"
STATES = "states"  # a distilled dataset's subfolder with its rows' hidden states (the cache's layout)
CONVERT_MANIFEST = "mtp_backbone.json"  # in a converted (GGUF -> safetensors) backbone's folder

# --- a training run ------------------------------------------------------------------------------
HEADS_FILE, HEADS_META = "heads.safetensors", "heads.json"
ADAPTER_DIR = "adapter"  # with backbone.lora: the trained LoRA adapters, a PEFT adapter directory
TREE_STATS = "tree_stats.json"
RUN_META = "run_meta.json"
RUN_CONFIG = "run_config.yaml"  # the resolved config of the run, written under the run lock
CHECKPOINTS, LAST_CKPT = "checkpoints", "last.ckpt"
SUPERSEDED = "superseded"
CSV_LOGS = "csv"

# --- a CLP run -----------------------------------------------------------------------------------
LABELS = "acceptance_labels"  # CLP's acceptance labels (not the token masks a dataset calls labels)
PREDICTOR_FILE, PREDICTOR_META = "predictor.safetensors", "predictor.json"
STAGE_TIMES = "stage_times.json"

# --- an evaluation -------------------------------------------------------------------------------
EVAL_REPORT = "eval_report.json"
OUTPUTS = "outputs.json"
SPEEDUP_PNG, ACCEPTANCE_PNG, VERIFY_COSTS_PNG = "speedup.png", "acceptance.png", "verify_costs.png"
SAMPLING_PNG = "sampling.png"  # tau and speedup per mode against the temperature (eval.sampling)
EVAL_PLOTS = (SPEEDUP_PNG, ACCEPTANCE_PNG, VERIFY_COSTS_PNG, SAMPLING_PNG)

# --- the demo pipeline and sweeps ----------------------------------------------------------------
TRAIN_DIR, CLP_DIR, EVAL_DIR = "train", "clp", "eval"
REPORT = "report.md"
TRAINING_CURVES = "training_curves.png"
SWEEP_REPORT = "sweep_report"  # .json, .md and .png beside a multirun's points


# --- prepared data, from the config ----------------------------------------------------------------

def labelled_dir(cfg) -> Path:
    return Path(cfg.data.output_dir) / LABELLED


def distilled_dir(cfg) -> Path:
    return Path(cfg.data.output_dir) / DISTILLED


def data_dirs(cfg) -> list[Path]:
    """The prepared datasets mtp-train reads, by train.data_use."""
    return {"labelled": [labelled_dir(cfg)], "distilled": [distilled_dir(cfg)],
            "mix": [labelled_dir(cfg), distilled_dir(cfg)]}[cfg.train.data_use]


def cache_dir(data_output_dir: str | Path, key: str) -> Path:
    """The cache folder for one cache key (see `mtp_train.data.cache.cache_key`)."""
    return Path(data_output_dir) / f"{CACHE_PREFIX}{key}"


def max_length(cfg) -> int:
    """The row length training crops to: train.max_length, else data.max_length."""
    return cfg.train.max_length or cfg.data.max_length


# --- runs --------------------------------------------------------------------------------------------

def last_checkpoint(run_dir: str | Path) -> Path:
    """Lightning's last checkpoint of a training run (a file, or a ZeRO shard directory)."""
    return Path(run_dir) / CHECKPOINTS / LAST_CKPT


HYDRA_OVERRIDES = "overrides.yaml"


def hydra_overrides(run_dir: str | Path) -> Path:
    return Path(run_dir) / HYDRA_DIR / HYDRA_OVERRIDES


def csv_metrics(run_dir: str | Path) -> list[Path]:
    """Lightning's CSVLogger files of a training run (csv/version_<n>, or csv/<point>/version_<n> in a
    sweep), oldest version first."""
    def version(path: Path) -> tuple:
        tail = path.parent.name.rsplit("_", 1)[-1]
        return (str(path.parent.parent), int(tail) if tail.isdigit() else -1, path.parent.name)

    return sorted(Path(run_dir, CSV_LOGS).glob("**/metrics.csv"), key=version)


def predictor_dir(clp_run: str | Path, kind: str) -> Path:
    """Where mtp-clp writes the predictor of one kind (clp, gate)."""
    return Path(clp_run) / kind


def pipeline_dirs(root: str | Path) -> tuple[Path, Path, Path]:
    """(train, clp, eval) run directories of a pipeline root such as runs/demo."""
    root = Path(root)
    return root / TRAIN_DIR, root / CLP_DIR, root / EVAL_DIR
