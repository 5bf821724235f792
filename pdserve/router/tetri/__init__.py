"""TetriInfer's scheduling in the router: reserved decode length and decode placement.

    reserve_mode.py   how many output tokens a decode hold covers (`--reserve static|dynamic`)
    decode_choice.py  `--decode-choice p2c`: power-of-two choices on heavy/light decode load
    tetri_runtime.py  the router process's side of admission (`--reserve`, `--predictor`)
"""
