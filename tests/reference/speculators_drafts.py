"""Run inside the reference environment (tests/reference/env.py), never in the project's own: load an
exported EAGLE-3 directory with `speculators`' own draft model class and write the tokens it drafts.

    python speculators_drafts.py EXPORT_DIR K ATTN INPUTS OUTPUT [INPUTS OUTPUT ...]

INPUTS (safetensors): `aux` (1, T, n * d) the backbone's auxiliary states at positions 0..T-1 and
`ids` (1, T) the tokens x_0..x_{T-1}. speculators pairs the state at t with the token x_{t+1} (its
data pipeline drops x_0), so the model reads aux[:, :-1] and ids[:, 1:]; depth s+1 at t then reads
x_{t+1+s}, the data's tokens (teacher forcing). OUTPUT (safetensors): `drafts` (K, T - 1), the
token ids (draft indices mapped through d2t) drafted at each depth and position.
"""

import sys

import torch
from safetensors.torch import load_file, save_file
from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(export_dir: str, k: int, attn: str, pairs: list[str]) -> None:
    config = Eagle3SpeculatorConfig.from_pretrained(export_dir)
    config.transformer_layer_config._attn_implementation = attn
    model = Eagle3DraftModel.from_pretrained(export_dir, config=config).float().eval()
    assert not torch.isnan(model.lm_head.weight).any(), "lm_head did not load from the export"
    for inputs, output in zip(pairs[::2], pairs[1::2], strict=True):
        x = load_file(inputs)
        aux, ids = x["aux"].float(), x["ids"].long()
        T = ids.shape[1]
        with torch.no_grad():
            drafts = model(hidden_states=aux[:, :-1], input_ids=ids[:, 1:],
                           document_ids=torch.zeros(1, T - 1, dtype=torch.long), ttt_steps=k)
        out = []
        for d in drafts:  # draft-vocabulary indices
            d = d[0].long()
            out.append(d + model.d2t[d] if model.d2t is not None else d)
        save_file({"drafts": torch.stack(out).contiguous()}, output)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:])
