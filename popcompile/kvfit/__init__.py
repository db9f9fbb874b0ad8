"""The pruned layers' K/V weights (POP+ and POP++): same nodes, other weights, no inference cost.

    corpus.py     the built-in calibration text (stdlib sources disjoint from the evaluation's)
    images.py     a vision-language model's calibration windows: a synthetic image, then that text
    calibrate.py  POP+: the closed-form ridge fit of each pruned layer's K/V projections to its true K/V
    distill.py    POP++: those weights trained on KL(full || POP)
    fit.py        resolve_fit, the one place every entry point (export, torch.compile, eval, the vLLM
                  target) gets K/V weights from
    budget.py     where a fit runs (KVFitConfig.device), its estimate before it starts, its time budget
                  (KVFitConfig.budget_s: distill over it falls back to ridge; a fit that runs out stops)

Names: a ``KVFit`` is the result (weights + CalibrationInfo), ``KVFitConfig`` how it is made. Functions are
verb first: ``resolve_fit`` / ``resolve_file_fit`` (which fit a kv_calibration asks for), ``fit_builtin`` /
``fit_on_tokens`` (make one), ``ridge_fit`` / ``ridge_fits`` (POP+ at one cut / at several), ``load_fit`` /
``load_file_fit`` / ``save_fit`` (files), ``check_fit`` / ``check_kv_shapes`` (against a cut / shapes).
"""
