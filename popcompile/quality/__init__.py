"""What POP keeps of the full model's answers, measured while compiling (``export --cut auto``).

    prompts.py   the quality floor's built-in held-out prompts (stdlib text held out of calibration and
                 evaluation; fixed-length windows, raw and under the chat template)
    floor.py     measure_cuts (first-token agreement and matched prefix of POP at every cut, teacher-forced
                 on the full model's greedy tokens), choose_cut, search, check_shipped

Part of the compiler (driver.py's "choose cut" and "check quality" steps), so it imports no measurement
tool (measure/): eval compares its choice against other cuts.
"""
