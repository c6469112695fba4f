"""The README's main job: the example trainer learns under the hybrid recipe and lands near BF16."""

import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _train():
    spec = importlib.util.spec_from_file_location("dtq_example_train", ROOT / "launch" / "train.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def test_hybrid_training_matches_bf16(capsys):
    main = _train()
    args = ["--steps", "40", "--batch", "64", "--width", "32", "--log-every", "40"]
    first = main(args + ["--steps", "1"])
    hybrid = main(args + ["--recipe", "hybrid"])
    bf16 = main(args + ["--recipe", "bf16"])
    out = capsys.readouterr().out
    assert "step   40/40" in out and "samples/s" in out
    # Loss must fall well below its starting value, and the 4-bit backward may cost at most 50%
    # over BF16 on this small regression (measured: within ~10%).
    assert hybrid < 0.5 * first
    assert hybrid < 1.5 * bf16
