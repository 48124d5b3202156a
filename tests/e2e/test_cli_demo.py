"""README command 1 (for now the ENTR demo) runs and shows what ENTR is for."""

import re
import subprocess
import sys


def test_demo_masks_noise_and_keeps_high_entropy_tokens():
    out = subprocess.run(
        [sys.executable, "-m", "entr_megatron.cli.main", "demo", "--positions", "4000", "--noise", "0.02"],
        capture_output=True, text=True, timeout=300, check=True,
    ).stdout
    m = re.search(r"noise tokens masked: entr (\d+)/(\d+), icepop (\d+)/\d+; "
                  r"high-entropy \(H >= 1\) tokens kept: entr ([\d.]+)%, icepop ([\d.]+)%", out)
    assert m, out
    entr_caught, n_noise, icepop_caught = int(m[1]), int(m[2]), int(m[3])
    entr_kept_high, icepop_kept_high = float(m[4]), float(m[5])
    # The injected noise lies inside IcePop's ratio band by construction, so the band keeps
    # all of it; ENTR's entropy-scaled bound at H < 0.05 masks most of it.
    assert n_noise > 0 and icepop_caught == 0 and entr_caught > 0.5 * n_noise
    assert entr_kept_high > icepop_kept_high
