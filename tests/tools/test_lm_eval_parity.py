"""tools/lm_eval_parity.py end to end (slow; needs the `eval` extra: `pip install -e
'.[eval]'`): lm-eval's multiple-choice and loglikelihood tasks through `jlco.serve` give
lm-eval's `hf` backend's per-sample log-likelihoods within 1e-3 and the same accuracy."""

import json
import subprocess
import sys

import pytest

from tests.support.server import ROOT


@pytest.mark.slow
def test_lm_eval_through_the_server_equals_its_hf_backend(tmp_path):
    pytest.importorskip("lm_eval", reason="the eval extra is not installed")
    pytest.importorskip("accelerate", reason="the eval extra is not installed")
    r = subprocess.run([sys.executable, "tools/lm_eval_parity.py", "--num_docs", "12",
                        "--batch_size", "4", "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    cmp = json.loads((tmp_path / "lm_eval_parity.json").read_text())["comparison"]
    for task in ("jlco_mc", "jlco_ll"):
        assert cmp[task]["max_abs_diff"] <= 1e-3 and cmp[task]["metrics_equal"], cmp[task]
