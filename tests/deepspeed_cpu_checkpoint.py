"""Helper of test_distributed (run as a script, DS_ACCELERATOR=cpu): one ZeRO-2 step of the heads of
an mtp-train run, saved the way Lightning's DeepSpeed strategy saves (tag 'checkpoint', parameter
names under `_forward_module.`), plus the engine's resulting weights as the expected export.

    python deepspeed_cpu_checkpoint.py <run dir> <checkpoint dir> <expected.safetensors>
"""

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
                  RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")

import deepspeed  # noqa: E402
import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from mtp_train.backbone import load_backbone  # noqa: E402
from mtp_train.distributed import deepspeed_config  # noqa: E402
from mtp_train.heads.persist import build_heads, heads_state_dict  # noqa: E402
from mtp_train.pipeline.export import load_recipe  # noqa: E402


class Holder(torch.nn.Module):  # stands for the LightningModule: the heads under `heads.`
    def __init__(self, heads):
        super().__init__()
        self.heads = heads


class Wrapper(torch.nn.Module):  # the prefix Lightning's DeepSpeed wrapper puts on names
    def __init__(self, module):
        super().__init__()
        self._forward_module = module


def main(run: str, out: str, expected: str) -> None:
    cfg = load_recipe(run)
    heads = build_heads(cfg.heads, load_backbone(cfg.backbone))
    model = Wrapper(Holder(heads))
    deepspeed.init_distributed(dist_backend="gloo")
    params = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=params, optimizer=torch.optim.AdamW(params, lr=1e-2),
        config=deepspeed_config(stage=2, bf16=False, micro_batch_size=1))
    loss = sum((p.float() ** 2).sum() for p in engine.module.parameters())
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(out, tag="checkpoint")
    os.remove(os.path.join(out, "latest"))  # Lightning's layout has no `latest` file
    save_file(heads_state_dict(heads), expected)


if __name__ == "__main__":
    main(*sys.argv[1:4])
