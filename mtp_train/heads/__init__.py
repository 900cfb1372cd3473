"""Draft heads: plain nn.Modules (no Lightning, no Hydra), one family a module.

    base.py      DraftHeads, the interface every family fills in
    registry.py  one record per heads.type: its classes, drafter, engine format and the settings it
                 accepts (imports nothing, so the config schema can read it)
    medusa.py, chained.py, eagle3.py   the families
    vocab.py     the draft vocabulary (heads that score only the most frequent tokens)
    persist.py   build heads from the config, save what trains, load trained heads
"""
