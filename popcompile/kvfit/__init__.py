"""The pruned layers' K/V weights (POP+ and POP++): same nodes, other weights, no inference cost.

    corpus.py     the built-in calibration text (stdlib sources disjoint from the evaluation's)
    images.py     a vision-language model's calibration windows: a synthetic image, then that text
    calibrate.py  POP+: the closed-form ridge fit of each pruned layer's K/V projections to its true K/V
    distill.py    POP++: those weights trained on KL(full || POP); kv_fit, the one place every entry
                  point (export, torch.compile, eval, the vLLM target) gets K/V weights from
"""
