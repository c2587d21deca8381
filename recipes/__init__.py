"""H100 pretraining recipes: pure builders `<model>_pretrain_<N>gpu_h100_<dtype>() -> ConfigContainer`.

Every module here registers its builders with `overlapkit.bridge.registry` (through `recipes._base.register`); the
registry finds the modules by name, so a new file (a fork from `make new-recipe`, or your own) needs no listing.
"""
