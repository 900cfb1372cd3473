"""Leaving one process: checks of the trainer config, the DeepSpeed config composed from Hydra, and
consolidation of a ZeRO checkpoint into `heads.safetensors`.

The engines are Lightning's strategies (ddp, deepspeed); this module only composes their inputs and
refuses, with the config key named, what cannot run on this machine.
"""

from __future__ import annotations

import math
import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from mtp_train.errors import ConfigError, MtpError

GPU_ACCELERATORS = ("gpu", "cuda")


def zero_config(strategy) -> dict:
    """The `zero_optimization` section of a (DeepSpeed) strategy's config; {} for any other."""
    cfg = getattr(strategy, "config", None)
    return cfg.get("zero_optimization") or {} if isinstance(cfg, dict) else {}


def strategy_name(strategy: Any) -> str:
    """'ddp', 'deepspeed', 'auto', ...: a strategy given as a string or as a `_target_` mapping."""
    if strategy is None:
        return "auto"
    if isinstance(strategy, str):
        return strategy.lower()
    target = str(strategy.get("_target_", "")) if hasattr(strategy, "get") else type(strategy).__name__
    return "deepspeed" if "deepspeed" in target.lower() else target.rsplit(".", 1)[-1].lower()


# what trainer.precision may be: Lightning's names for the precisions the heads train in (16-mixed for
# GPUs without bf16), and auto (mtp_train/lit/step_options.py); 64-true and the rest are not offered
TRAIN_PRECISIONS = ("auto", "32-true", "32", "bf16-mixed", "16-mixed")


def check_trainer(trainer: dict, gpus: int | None = None, cpus: int | None = None,
                  multirun: bool = False, heads_given: bool = False) -> None:
    """Refuse a trainer config this machine cannot run, naming the key, before Lightning starts.
    `heads_given` (heads.from_speculators): trainer.max_steps=0 is allowed, the heads being trained."""
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    cpus = cpus or os.cpu_count() or 1
    steps, epochs = trainer.get("max_steps", -1), trainer.get("max_epochs")
    for key in ("max_steps", "max_epochs", "val_check_interval", "check_val_every_n_epoch"):
        value = trainer.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ConfigError(f"trainer.{key}: {value!r} is not a number")
    vci = trainer.get("val_check_interval")
    if vci is not None and (not isinstance(vci, int) or vci <= 0):
        # validation counts steps across epochs (check_val_every_n_epoch: null), and the periodic
        # checkpoint is saved at the same steps: a whole number of steps, not a fraction of an epoch
        raise ConfigError(f"trainer.val_check_interval: {vci}; give a whole positive number of training steps "
                          "(validation and the periodic checkpoint run every that many steps)")
    if steps is not None and ((steps == 0 and not heads_given) or steps < -1):
        raise ConfigError(f"trainer.max_steps: {steps} trains nothing (and would write untrained heads); "
                          "give a positive number, or -1 to let trainer.max_epochs decide")
    if epochs is not None and epochs == 0:
        raise ConfigError("trainer.max_epochs: 0 trains nothing (and would write untrained heads)")
    if steps in (None, -1) and (epochs is None or epochs < 1) and not trainer.get("max_time"):
        raise ConfigError(f"trainer.max_steps: {steps} leaves the length of training to trainer.max_epochs, "
                          f"which is {epochs} (Lightning would then train 1000 epochs); give max_steps, a "
                          "positive trainer.max_epochs, or trainer.max_time")
    precision = str(trainer.get("precision", "32-true"))
    if precision not in TRAIN_PRECISIONS:
        raise ConfigError(f"trainer.precision: {precision!r}; the heads train in one of "
                          f"{', '.join(TRAIN_PRECISIONS)} (auto: bf16-mixed or 32-true, whichever is faster here)")
    clip = trainer.get("gradient_clip_val")
    if clip is not None and (isinstance(clip, bool) or not isinstance(clip, (int, float))
                             or not math.isfinite(clip) or clip < 0):
        raise ConfigError(f"trainer.gradient_clip_val: {clip!r}; give a finite number >= 0 (0 or null: no clipping)")
    accel = str(trainer.get("accelerator", "auto")).lower()
    devices = trainer.get("devices", 1)
    strategy = strategy_name(trainer.get("strategy"))
    if strategy.startswith("deepspeed") and (accel == "cpu" or gpus == 0):
        raise ConfigError("trainer.strategy: Lightning's DeepSpeed strategy runs on CUDA GPUs only and "
                          f"{'trainer.accelerator is cpu' if accel == 'cpu' else 'no CUDA GPU is visible'}; "
                          "use trainer=ddp for several CPU processes, or trainer=cpu")
    if accel in GPU_ACCELERATORS and gpus == 0:
        raise ConfigError(f"trainer.accelerator: {accel!r} asked, but no CUDA GPU is visible; "
                          "use trainer=cpu or trainer=ddp")
    if isinstance(devices, int) or (isinstance(devices, str) and devices.isdigit()):
        n = int(devices)
        if n < 1:
            raise ConfigError(f"trainer.devices: {n}; give at least 1")
        if accel in GPU_ACCELERATORS and n > gpus:
            raise ConfigError(f"trainer.devices: {n} GPUs asked, {gpus} visible on this node")
        if accel == "cpu" and n > cpus:
            raise ConfigError(f"trainer.devices: {n} CPU processes asked, this machine has {cpus} cores")
        if multirun and n > 1 and "SLURM_NTASKS" not in os.environ:
            # Lightning would relaunch the whole command line, -m included: every rank a new sweep
            raise ConfigError(f"trainer.devices: {n} processes inside a local multirun (-m); run the "
                              "points one by one, or sweep with hydra/launcher=slurm and "
                              "hydra.launcher.tasks_per_node=trainer.devices")


def deepspeed_config(stage: int, offload_optimizer: bool = False, offload_parameters: bool = False,
                     bf16: bool | None = None, micro_batch_size: int | None = None,
                     gradient_clipping: float | None = None, allgather_bucket_size: float = 2e8,
                     reduce_bucket_size: float = 2e8, overlap_comm: bool = True,
                     contiguous_gradients: bool = True, stage3_prefetch_bucket_size: float = 5e7,
                     stage3_param_persistence_threshold: float = 1e5,
                     stage3_max_live_parameters: float = 1e9, pin_memory: bool = True) -> dict:
    """A DeepSpeed JSON config (as a dict) from the knobs conf/trainer/deepspeed_*.yaml exposes.

    Lightning's DeepSpeedStrategy takes it as `config=`; it fills in what it owns when missing
    (gradient accumulation and clipping, and the bf16/fp16 section from `trainer.precision`). `zero_allow_untested_optimizer` lets the module's AdamW through;
    with an offloaded optimizer the module uses DeepSpeed's own CPU Adam instead.
    """
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"trainer.strategy.config.stage: ZeRO stage {stage}; use 0, 1, 2 or 3")
    if offload_parameters and stage != 3:
        raise ConfigError("trainer.strategy.config.offload_parameters: parameter offload needs ZeRO stage 3")
    zero: dict[str, Any] = {"stage": stage, "overlap_comm": overlap_comm,
                            "contiguous_gradients": contiguous_gradients,
                            "reduce_bucket_size": int(float(reduce_bucket_size))}
    if stage in (1, 2):
        zero.update(allgather_partitions=True, allgather_bucket_size=int(float(allgather_bucket_size)),
                    reduce_scatter=True)
    if stage == 3:
        zero.update(stage3_prefetch_bucket_size=int(float(stage3_prefetch_bucket_size)),
                    stage3_param_persistence_threshold=int(float(stage3_param_persistence_threshold)),
                    stage3_max_live_parameters=int(float(stage3_max_live_parameters)),
                    stage3_gather_16bit_weights_on_model_save=True)
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin_memory}
    if offload_parameters:
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin_memory}
    cfg: dict[str, Any] = {"zero_optimization": zero, "zero_allow_untested_optimizer": True}
    if bf16 is not None:  # None: Lightning writes bf16/fp16 from trainer.precision
        cfg["bf16"] = {"enabled": bool(bf16)}
    if micro_batch_size is not None:
        cfg["train_micro_batch_size_per_gpu"] = int(micro_batch_size)
    if gradient_clipping is not None:
        cfg["gradient_clipping"] = float(gradient_clipping)
    return cfg


def validate_deepspeed_config(cfg: dict) -> None:
    """Parse `cfg` with DeepSpeed's own config class (the parser `deepspeed.initialize` uses), for
    one process: the batch fields Lightning fills in at launch get their one-process values."""
    from deepspeed.runtime.config import DeepSpeedConfig

    full = dict(cfg)
    full.setdefault("train_micro_batch_size_per_gpu", 1)
    full.setdefault("gradient_accumulation_steps", 1)
    full.setdefault("train_batch_size",
                    full["train_micro_batch_size_per_gpu"] * full["gradient_accumulation_steps"])
    try:
        DeepSpeedConfig(full)
    except Exception as e:  # DeepSpeed raises assertion and value errors of its own
        raise ConfigError(f"trainer.strategy.config: DeepSpeed rejects the composed config: {e}") from e


def zero_file_types() -> list:
    """The only non-tensor, non-container types DeepSpeed's ZeRO files hold (its optimizer shards;
    checked with `torch.serialization.get_unsafe_globals_in_checkpoint` on deepspeed 0.19): plain
    data classes and an enum, which a weights-only load may rebuild without running their code."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]  # Dynamic: fp16 runs


@contextmanager
def weights_only_loads(allowed: list):
    """Every `torch.load` inside the block loads weights only (tensors, containers and `allowed`),
    whatever its caller asks for: DeepSpeed's consolidation passes weights_only=False, and a run
    directory copied from elsewhere must never execute code when it is read."""
    import torch

    original = torch.load

    def load(*args, **kwargs):
        kwargs["weights_only"] = True
        return original(*args, **kwargs)

    with torch.serialization.safe_globals(allowed):
        torch.load = load
        try:
            yield
        finally:
            torch.load = original


def refused_object(error: Exception) -> str:
    """The object a weights-only load refused, out of torch's message (mostly advice to load
    unsafely or to allow-list); '?' when it names none."""
    found = re.search(r"GLOBAL ([\w.]+)", str(error))
    return found.group(1) if found else "?"


class CheckpointRefused(MtpError):
    """A checkpoint file holds objects a weights-only load refuses: loading it could run code."""

    def __init__(self, name: str):
        super().__init__(f"it names {name}")
        self.name = name


class CheckpointUnreadable(MtpError):
    """A file that is not a torch archive, or a damaged one; `detail` is torch's first line."""

    def __init__(self, detail: str):
        super().__init__(detail)
        self.detail = detail


def load_weights_only(path: Path, mmap: bool = False):
    """torch.load of a checkpoint file, tensors and plain containers only. Raises CheckpointRefused
    (naming the object) or CheckpointUnreadable (torch's first line, not its advice to load unsafely)."""
    import pickle

    import torch

    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        if (name := refused_object(e)) != "?":
            raise CheckpointRefused(name) from None
        raise CheckpointUnreadable("not a torch archive") from None
    except Exception as e:  # torch reports a damaged archive as several error types
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointUnreadable(f"{type(e).__name__}: {first}") from None


def atomic_checkpoint_io():
    """A Lightning CheckpointIO that publishes a checkpoint only once it is whole
    (mtp_train/checkpoint_io.py)."""
    from mtp_train.checkpoint_io import AtomicCheckpointIO

    return AtomicCheckpointIO()


def trainer_plugins(trainer: dict) -> dict:
    """Extra Trainer kwargs: the atomic checkpoint writer, unless trainer.plugins names plugins of
    its own (a DeepSpeed strategy writes its ZeRO directory itself and never calls it)."""
    if trainer.get("plugins") or strategy_name(trainer.get("strategy")).startswith("deepspeed"):
        return {}
    return {"plugins": [atomic_checkpoint_io()]}


def zero_state_dict(checkpoint: Path) -> dict:
    """The fp32 state dict of a ZeRO checkpoint directory (Lightning's `last.ckpt/` layout or a
    DeepSpeed save dir), gathered from every rank's shards by DeepSpeed's own consolidation, with
    every file loaded weights-only (a file holding anything else is refused, not run)."""
    import pickle

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    checkpoint = Path(checkpoint)
    tag = None
    if (checkpoint / "checkpoint").is_dir() and not (checkpoint / "latest").is_file():
        tag = "checkpoint"  # Lightning saves under this tag without a `latest` file
    try:
        with weights_only_loads(zero_file_types()):
            return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag=tag)
    except pickle.UnpicklingError as e:
        what = f"it names {refused_object(e)}"
        raise MtpError(f"{checkpoint}: refusing to load this ZeRO checkpoint: a file in it holds more than "
                       f"tensors and DeepSpeed's own records, and loading it could run code ({what})") from e
    except (FileNotFoundError, ValueError, KeyError, RuntimeError) as e:
        raise MtpError(f"{checkpoint}: not a DeepSpeed ZeRO checkpoint ({e})") from e


def heads_from_module_state(state: dict, part: str = "heads") -> dict:
    """The heads' tensors (or, with part="adapters", the LoRA adapters') out of a LightningModule
    state dict, whatever wrapper prefix it carries."""
    out, key = {}, part + "."
    for name, t in state.items():
        i = name.find(key)
        if i >= 0 and (i == 0 or name[i - 1] == "."):
            out[name[i + len(key):]] = t
    return out
