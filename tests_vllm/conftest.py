"""tests_vllm/ fixtures shared by both modules (helpers: serving.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
from serving import CUT, LAYERS, THRESHOLD, calibrate, export, load


@pytest.fixture(scope="session")
def folders(tmp_path_factory) -> dict[str, Path]:
    """SmolLM2's folders, the model loaded once: pop (cut 20), full (cut 30), pop+ (cut 20 and the fit of
    ``popcompile calibrate --cut 20 --max-tokens 2048``), threshold (cut 20, min_prompt_tokens 400), the fit
    itself, and vanilla (the pop folder as stock vLLM sees it). test_vllm_disagg.py serves "pop" too (it only
    reads the folder). The fit's 2048 tokens (one [4, 512] batch) make it a valid fit in a quarter of the
    time of 8192: its tests compare vLLM with the reference on the same fitted weights, whatever they are."""
    from popcompile.exporters.vllm import stock_view

    root = tmp_path_factory.mktemp("served")
    loaded = load("smollm2-135m")
    fit = calibrate(loaded, root / "fit.safetensors", cut=CUT, max_tokens=2048)
    folders = {"pop": export(loaded, root / "pop", cut=CUT),
               "full": export(loaded, root / "full", cut=LAYERS),
               "pop+": export(loaded, root / "pop+", cut=CUT, kv_calibration=fit),
               "threshold": export(loaded, root / "threshold", cut=CUT, min_prompt_tokens=THRESHOLD),
               "fit": fit}
    vanilla = stock_view(folders["pop"], root / "vanilla")  # the same folder as stock vLLM sees it
    return {**folders, "vanilla": vanilla}
