"""The head families, one record each: what `heads.type` names and everything that differs by family.

A record names its classes by import path ("module:Class") and resolves them on use, so this module
imports nothing heavy: the config schema reads it to validate `heads.*`, the decoder to pick a
drafter, the export to pick a format. Adding a family means one heads module (a `DraftHeads`), one
drafter module (under `mtp_train/decoding/drafters/`) and one record here (docs/architecture.md).
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class HeadFamily:
    name: str  # the heads.type value
    heads: str  # "module:Class" of its nn.Module, a heads.base.DraftHeads
    drafter: str  # "module:Class" of the decoder's drafter for it
    engine_format: str | None  # the serving engines' format it is exported in (mtp-export-heads --format)
    no_engine_format: str  # why it has none (when engine_format is None)
    inits: tuple[str, ...]  # heads.init values it accepts
    lm_heads: tuple[str, ...]  # heads.lm_head values it accepts
    shares_modules: bool  # whether heads.share=true means something for it
    reads_aux: bool  # whether it reads backbone layers besides the final state (heads.aux_layers)
    # what its heads are, in a phrase (refusals name it: "Medusa heads are residual blocks on ...")
    what: str = ""

    def heads_class(self):
        return _resolve(self.heads)

    def drafter_class(self):
        return _resolve(self.drafter)


def _resolve(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


FAMILIES: dict[str, HeadFamily] = {f.name: f for f in (
    HeadFamily(
        name="medusa", heads="mtp_train.heads.medusa:MedusaHeads",
        drafter="mtp_train.decoding.drafters.medusa:MedusaDrafter",
        engine_format="medusa", no_engine_format="",
        inits=("random",), lm_heads=("shared", "copy"), shares_modules=False, reads_aux=False,
        what="position-wise residual blocks on the backbone's final state"),
    HeadFamily(
        name="chained", heads="mtp_train.heads.chained:ChainedMTP",
        drafter="mtp_train.decoding.drafters.chained:ChainedDrafter",
        engine_format=None,
        no_engine_format="no engine serves chained MTP modules on a backbone that has none built in: "
                         "they read [emb; h] through separate per-depth modules and the final state "
                         "only (train heads=eagle3 or heads=medusa to serve)",
        inits=("random", "copy_last"), lm_heads=("shared",), shares_modules=True, reads_aux=False,
        what="per-depth transformer modules that attend over earlier positions and read drafted tokens"),
    HeadFamily(
        name="eagle3", heads="mtp_train.heads.eagle3:Eagle3Heads",
        drafter="mtp_train.decoding.drafters.eagle3:Eagle3Drafter",
        engine_format="eagle3", no_engine_format="",
        inits=("random", "final_state"), lm_heads=("shared", "copy"), shares_modules=False, reads_aux=True,
        what="one attention layer over fused backbone layers that reads drafted tokens"),
)}


# mtp-export-heads --format: the run's own layout, or an engine's
EXPORT_FORMATS = ("native", *dict.fromkeys(f.engine_format for f in FAMILIES.values() if f.engine_format))


def family(name: str) -> HeadFamily:
    """The record of heads.type `name`."""
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown head family {name!r}; known: {', '.join(FAMILIES)}") from None


def family_for_format(fmt: str) -> HeadFamily | None:
    """The family an engine format writes, or None."""
    return next((f for f in FAMILIES.values() if f.engine_format == fmt), None)
