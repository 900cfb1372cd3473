"""mtp-prep: prepare the backbone and the data that heads train on.

Stages (each skips itself when its manifest says it is up to date; `force=true` redoes it):
  backbone  locate the backbone; a GGUF one is converted once to safetensors under paths.cache_dir
  data      conversations -> chat template -> assistant-only labels -> train/validation Arrow dataset
  distill   the backbone regenerates the answers (resumable: a killed run continues from its shards)
  cache     the backbone's hidden states for the rows mtp-train reads (train.data_use), which
            mtp-train then uses instead of running the backbone (asked for by name, not in `all`)
  all       backbone, data, distill in order

  mtp-prep experiment=smollm2_demo                # the demo: SmolLM2 + ShareGPT, all stages
  mtp-prep stage=data data=sharegpt data.max_conversations=null
  mtp-prep stage=all data=jsonl data.path=my_prompts.jsonl backbone=hf backbone.path=/models/llama
  mtp-prep debug=smoke                            # the tiny in-code data, in seconds (smoke runs)
"""

from __future__ import annotations

import hydra

from data_prep.stages import print_summary, run_prep
from mtp_train.cli.common import CONF_DIR, entry, offline_environment, run_app
from mtp_train.config import Config


@hydra.main(version_base="1.3", config_path=CONF_DIR, config_name="config")
@entry
def app(cfg, typed: Config):
    results = run_prep(typed)
    print_summary(results)
    return None


def main() -> None:
    offline_environment()
    run_app(app)


if __name__ == "__main__":
    main()
